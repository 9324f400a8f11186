"""A batch's outputs split into its entries' replies (workers/batch_run.py): each entry gets
its own rows of the outputs it asked for, and without an axis to cut back the output is
made bytes once for the batch, each reply's tensor a slice of them."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import numpy.typing as npt

from batching.envelope import Reply, Request, Tensor
from batching.former import Batch, Entry, Layout
from workers.batch_run import BatchRunner, Outcome

Arrays = dict[str, npt.NDArray[Any]]


class Means:
    """Each row's mean (FP32) and its index in the batch (INT64)."""

    def predict(self, inputs: Arrays) -> Arrays:
        x = inputs["x"]
        return {"mean": x.mean(axis=1, dtype=np.float32).reshape(-1, 1),
                "row": np.arange(x.shape[0], dtype=np.int64).reshape(-1, 1)}


def _entry(rows: int, first: int, outputs: list[str]) -> Entry:
    x = np.arange(first * 4, (first + rows) * 4, dtype=np.float32).reshape(rows, 4)
    request = Request(uuid.uuid4().hex, "reply", int(time.time() * 1000) + 60_000,
                      time.time() * 1000, 1, [Tensor.from_array("x", x)], outputs)
    return Entry("stream", f"1-{first}", request, time.time())


def _run(entries: list[Entry]) -> list[Reply]:
    runner = BatchRunner("means", Layout(), Means(), {}, {})
    batch = Batch(entries, "full", Layout())
    answered = runner.run_entries(entries, Outcome(batch, time.time()))
    assert [entry for entry, _ in answered] == entries
    return [reply for _, reply in answered]


def test_each_entry_gets_its_own_rows_of_the_outputs_it_asked_for() -> None:
    entries = [_entry(1, 0, []), _entry(2, 1, ["row"]), _entry(1, 3, ["mean"])]
    got = [{t.name: (t.datatype, t.array()) for t in reply.outputs} for reply in _run(entries)]
    assert sorted(got[0]) == ["mean", "row"] and list(got[1]) == ["row"]
    assert list(got[2]) == ["mean"]
    assert got[0]["mean"][0] == "FP32" and got[1]["row"][0] == "INT64"
    assert got[0]["row"][1].tolist() == [[0]] and got[1]["row"][1].tolist() == [[1], [2]]
    assert got[2]["mean"][1].tolist() == [[13.5]]
    assert all(reply.batch_rows == 4 for reply in _run(entries))


def test_a_batch_output_is_made_bytes_once_and_each_reply_slices_them() -> None:
    replies = _run([_entry(1, 0, []), _entry(2, 1, []), _entry(1, 3, [])])
    for name in ("mean", "row"):
        raws = [next(t.raw for t in reply.outputs if t.name == name) for reply in replies]
        assert all(isinstance(raw, memoryview) for raw in raws)
        owners = {id(raw.obj) for raw in raws if isinstance(raw, memoryview)}
        assert len(owners) == 1
    packed = Reply.decode(replies[1].encode())  # a slice packs as the bytes it views
    assert packed.outputs[0].array().tolist() == [[5.5], [9.5]]
