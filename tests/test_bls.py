"""Calls from ``predict`` to other models (batching/bls.py, workers/model_calls.py): the
batch's context, the deadline and priority arithmetic, the entry, the shared reply list."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest
import redis

from batching import bls
from batching.config import ModelConfig
from batching.envelope import Reply, Request, Tensor
from batching.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelCallFailed,
    ModelFailure,
    Overloaded,
    call_failed,
)
from batching.former import Batch, Entry, Layout
from batching.keys import Keys
from batching.settings import Settings
from tests.procs import ROOT, RedisServer
from workers.batch_run import BatchRunner, Outcome
from workers.model_calls import ModelCalls, ReplyBox

CONFIG = ModelConfig.from_dict("twice", {
    "backend": "python", "max_batch_size": 8, "queue": {"priority_levels": 2},
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]}, "python")


class Recorder:
    """A caller that answers ``y = 2x`` and records each call's model, deadline, priority."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def call(self, model: str, inputs: Mapping[str, npt.NDArray[Any]], deadline_ms: int,
             priority: int) -> bls.Arrays:
        self.calls.append((model, deadline_ms, priority))
        return {"y": inputs["x"] * 2}


def test_a_batch_carries_its_earliest_deadline_and_most_urgent_priority() -> None:
    context = bls.BatchContext("m", ((2, 5000, 3), (1, 3000, 2), (3, 4000, 1)), Recorder())
    assert (context.deadline_ms, context.priority) == (3000, 1)
    assert context.of_rows(None) == (3000, 1)
    assert context.of_rows(slice(0, 2)) == (5000, 3)  # rows of the first request only
    assert context.of_rows(slice(1, 3)) == (3000, 2)
    assert context.of_rows(slice(5, 6)) == (4000, 1)
    assert context.of_rows(slice(-1, None)) == (4000, 1)
    assert bls.call_deadline_ms(3000, 1000.0, None) == 3000
    assert bls.call_deadline_ms(3000, 1000.0, 0.5) == 1500  # its own timeout is sooner
    assert bls.call_deadline_ms(3000, 1000.0, 10.0) == 3000  # never later than the batch's


def test_a_call_is_an_entry_of_the_called_model_with_the_batch_deadline_and_priority() -> None:
    x = np.ones((3, 4), np.float32)
    request = bls.call_request(CONFIG, {"x": x}, "7", "cv:reply:{me}", 9000, 3, 100.0)
    back = Request.decode(request.encode())
    assert (back.id, back.reply, back.deadline_ms, back.enq_ms) == ("7", "cv:reply:{me}", 9000,
                                                                   100.0)
    assert back.prio == 2  # held within the called model's levels
    assert back.rows == 3 and np.array_equal(back.inputs[0].array(), x)
    with pytest.raises(InvalidInput, match="FP32"):
        bls.call_request(CONFIG, {"x": x.astype(np.float64)}, "8", "r", 9000, 1, 100.0)


def test_infer_works_inside_predict_only_and_never_calls_its_own_model() -> None:
    with pytest.raises(RuntimeError, match="inside a served model's predict"):
        bls.infer("twice", {"x": np.ones((1, 4), np.float32)})
    caller = Recorder()
    with bls.batch(bls.BatchContext("caller", ((1, 9_999_999_999_999, 2),), caller)):
        with pytest.raises(ModelFailure, match="'caller' called itself"):
            bls.infer("caller", {"x": np.ones((1, 4), np.float32)})
        out = bls.infer("twice", {"x": np.ones((1, 4), np.float32)}, timeout_s=1.0)
        assert bls.current().priority == 2
    assert np.array_equal(out["y"], np.full((1, 4), 2, np.float32))
    [(model, deadline, priority)] = caller.calls
    assert model == "twice" and priority == 2
    assert abs(deadline - (time.time() * 1000 + 1000)) < 500


def test_async_calls_run_at_once_in_the_batch_context() -> None:
    caller = Recorder()
    x = np.ones((1, 4), np.float32)

    async def both() -> list[bls.Arrays]:
        return list(await asyncio.gather(bls.async_infer("a", {"x": x}),
                                         bls.async_infer("b", {"x": x})))

    async def per_row() -> bls.Arrays:
        return await bls.async_infer("c", {"x": x}, rows=slice(1, 2))

    with bls.batch(bls.BatchContext("caller", ((1, 5000, 1), (1, 8000, 3)), caller)):
        answers = asyncio.run(both())
        asyncio.run(per_row())
    assert [a["y"][0, 0] for a in answers] == [2.0, 2.0]
    assert sorted(caller.calls) == [("a", 5000, 1), ("b", 5000, 1), ("c", 8000, 3)]


def test_a_called_models_error_keeps_its_type_and_names_the_model() -> None:
    error = call_failed("slow", DeadlineExceeded.code, "late")
    assert isinstance(error, ModelCallFailed) and isinstance(error, DeadlineExceeded)
    assert (error.model, error.code, error.http_status) == ("slow", "deadline_exceeded", 504)
    assert error.message == "model 'slow' called from predict failed: late"
    full = call_failed("busy", Overloaded.code, "full")
    assert isinstance(full, Overloaded) and full.retry_after_s == 1
    assert type(call_failed("x", "no such code", "?")).__mro__[2].__name__ == "ConveyorError"


def entry(request_id: str, deadline_ms: int, prio: int) -> Entry:
    x = Tensor.from_array("x", np.ones((1, 4), np.float32))
    return Entry("s", f"{request_id}-0", Request(request_id, "r", deadline_ms, 0.0, prio, [x]),
                 0.0)


class Calling:
    """A model whose predict calls ``twice``."""

    def predict(self, inputs: bls.Arrays) -> bls.Arrays:
        return bls.infer("twice", inputs)


def test_the_runner_runs_predict_in_its_batch_context() -> None:
    runner = BatchRunner("caller", Layout.of(CONFIG), Calling(), {}, {})
    runner.calls = caller = Recorder()
    entries = [entry("a", 8000, 3), entry("b", 6000, 2), entry("c", 7000, 3)]
    answered = runner.run_entries(entries, Outcome(Batch(entries, "", Layout.of(CONFIG)), 0.0))
    assert all(reply.ok for _, reply in answered)
    assert caller.calls == [("twice", 6000, 2)]


def test_one_pop_at_a_time_serves_every_waiting_call() -> None:
    box = ReplyBox()
    pending: list[bytes] = []
    pops = 0
    lock = threading.Lock()

    def pop(wait_s: float) -> list[bytes]:
        nonlocal pops
        with lock:
            pops += 1
            taken, pending[:] = list(pending), []
        if not taken:
            time.sleep(min(wait_s, 0.01))
        return taken

    deadline = int(time.time() * 1000) + 10_000
    got: dict[str, str] = {}

    def wait(request_id: str) -> None:
        box.expect(request_id)
        got[request_id] = box.wait(pop, request_id, deadline).id

    threads = [threading.Thread(target=wait, args=(str(i),)) for i in range(4)]
    for thread in threads:
        thread.start()
    with lock:
        pending.extend(Reply(str(i)).encode() for i in (3, 1, 0, 2, 9))  # 9: nobody waits
    for thread in threads:
        thread.join(10)
    assert got == {str(i): str(i) for i in range(4)}
    box.expect("late")
    with pytest.raises(DeadlineExceeded, match="batch's deadline"):
        box.wait(pop, "late", int(time.time() * 1000) + 50)


def test_a_reply_popped_before_its_call_waits_is_kept() -> None:
    """A call is sent, then waits; another call's pop in between may take its reply."""
    box = ReplyBox()
    replies = [[Reply("a").encode(), Reply("b").encode()]]
    box.expect("a")  # "a" is sent: its reply and "b"'s arrive in the one pop "b" makes
    box.expect("b")
    deadline = int(time.time() * 1000) + 10_000
    assert box.wait(lambda _: replies.pop() if replies else [], "b", deadline).id == "b"
    assert box.wait(lambda _: [], "a", int(time.time() * 1000) + 200).id == "a"
    box.expect("c")
    box.forget("c")  # never sent: a late reply of it is not kept
    box.expect("d")
    box.wait(lambda _: [Reply("c").encode(), Reply("d").encode()], "d", deadline)
    with pytest.raises(DeadlineExceeded):
        box.wait(lambda _: [], "c", int(time.time() * 1000) + 50)


def test_a_call_enters_the_called_models_stream_and_waits_only_until_its_deadline(
        redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    shutil.copytree(ROOT / "tests" / "bls_models" / "twice", tmp_path / "twice")
    config = tmp_path / "twice" / "config.yaml"
    config.write_text(config.read_text().replace("priority_levels: 3",
                                                 "priority_levels: 3\n  max_queue_rows: 4"))
    calls = ModelCalls(Settings(redis_url=redis_server.url, model_repository=tmp_path,
                                key_prefix=keys.prefix), client)
    x = np.ones((3, 4), np.float32)
    deadline = int(time.time() * 1000) + 300
    with pytest.raises(DeadlineExceeded) as late:  # no worker reads twice here
        calls.call("twice", {"x": x}, deadline, 2)
    assert isinstance(late.value, ModelCallFailed) and late.value.model == "twice"
    assert time.time() * 1000 - deadline < 1000
    [(_, fields)] = cast(list[tuple[bytes, dict[bytes, bytes]]],
                         client.xrange(keys.queue("twice", 2)))
    entry = Request.decode(fields[b"d"])
    assert (entry.deadline_ms, entry.prio, entry.reply) == (deadline, 2, calls.reply_key)
    with pytest.raises(Overloaded, match="max_queue_rows"):  # 3 rows wait of 4
        calls.call("twice", {"x": x}, deadline + 10_000, 2)
    with pytest.raises(ModelFailure, match="'missing' called from predict failed: it cannot"):
        calls.call("missing", {"x": x}, deadline + 10_000, 2)
    with pytest.raises(ModelFailure, match="FP32"):  # the caller's mistake, not its client's
        calls.call("twice", {"x": x.astype(np.float64)}, deadline + 10_000, 2)
