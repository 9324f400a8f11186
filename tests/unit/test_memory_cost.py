"""The memory cap on rows times padded length: long and short requests share one limit."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from typing import Any

import numpy as np
import numpy.typing as npt

from batching.config import BatchingConfig, ModelConfig, TensorSpec
from batching.envelope import Reply, Request, Tensor
from batching.former import BatchFormer, Entry, Layout
from batching.keys import Keys
from batching.memory import PROBE_AFTER, UNBOUNDED, RowCap
from batching.policy import FixedWindow
from workers.inference import InferenceLoop
from workers.memory_streams import MemoryReclaimer, MemoryStreams
from workers.shared_state import SharedState

KEYS = Keys("t")
REPLY = "reply:test"
FITS = 24
"""The test device holds batches of at most this many rows x padded length."""


class DeviceOutOfMemory(RuntimeError):
    """onnxruntime's allocation failure, known to ``is_out_of_memory`` by its module."""


DeviceOutOfMemory.__module__ = "onnxruntime.capi.onnxruntime_pybind11_state"


class Tokens:
    """Doubles ``tokens``; out of memory above ``FITS`` rows x length; records each call's
    (rows, length) and whether it fitted."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool]] = []

    def predict(self, inputs: dict[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        rows, length = inputs["tokens"].shape
        fits = rows * length <= FITS
        self.calls.append((rows, length, fits))
        if not fits:
            raise DeviceOutOfMemory("Failed to allocate memory for requested buffer")
        return {"doubled": inputs["tokens"] * 2}


def tokens(length: int) -> Request:
    now_ms = int(time.time() * 1000)
    return Request(uuid.uuid4().hex, REPLY, now_ms + 60_000, now_ms, 2,
                   [Tensor.from_array("tokens", np.ones((1, length), np.int64))])


def test_a_cost_cap_halves_on_oom_and_probes_up_by_one_row_of_the_batch() -> None:
    cap = RowCap(UNBOUNDED)
    cap.on_success(8 * 100, 100)  # no cap before an out-of-memory error: nothing to learn
    assert cap.cap == UNBOUNDED
    cap.on_oom(8 * 10)  # 8 rows of length 10
    assert (cap.cap, cap.ceiling) == (40, 79)
    for _ in range(PROBE_AFTER):
        cap.on_success(4 * 10, 10)  # full: a fifth row of length 10 would not fit
    assert cap.cap == 50
    for _ in range(PROBE_AFTER):
        cap.on_success(2 * 10, 10)  # not full: says nothing
    assert cap.cap == 50
    for _ in range(4 * PROBE_AFTER):
        cap.on_success(cap.cap, 10)
    assert cap.cap == 79  # never above what ran out


def test_the_former_fits_rows_to_the_cap_by_their_padded_length() -> None:
    layout = Layout(pad={"tokens": (1, 0)})
    f = BatchFormer(FixedWindow(16, 60.0), 16, layout, max_padded=24)

    def entry(n: int, length: int) -> Entry:
        return Entry("s", f"{n}-0", tokens(length), time.time())

    f.add([entry(n, 8) for n in range(5)])
    decision = f.decide(time.time())
    assert decision.dispatch and decision.reason == "full"  # the window would wait
    assert len(f.take(decision.reason).entries) == 3
    f.take("drain")
    f.add([entry(n, 2) for n in range(14)])
    assert len(f.take("window").entries) == 12
    f.take("drain")
    f.add([entry(1, 2), entry(2, 2), entry(3, 12), entry(4, 2)])
    assert len(f.take("window").entries) == 2  # a third row would pad all three to 12


def test_long_and_short_inputs_share_one_learned_limit() -> None:
    config = ModelConfig(
        "m", "python", 16,
        inputs=(TensorSpec("tokens", "INT64", (-1, -1), pad_axis=1),),
        outputs=(TensorSpec("doubled", "INT64", (-1, -1), pad_axis=1),),
        batching=BatchingConfig(max_queue_delay_us=0, adaptive=False))
    streams = MemoryStreams(KEYS.queues("m", config.queue.priority_levels))
    model = Tokens()
    loop = InferenceLoop(config, model, streams, MemoryReclaimer(streams),
                         SharedState(multiprocessing.get_context("spawn")), KEYS)

    def run(length: int, count: int) -> list[tuple[int, int, bool]]:
        for _ in range(count):
            streams.put(tokens(length))
        before = len(model.calls)
        while streams.rows_waiting:
            loop.step()
        answered = [Reply.decode(b) for b in streams.lists.pop(REPLY)]
        assert len(answered) == count and all(r.ok for r in answered)
        return model.calls[before:]

    learning = run(8, 8)  # 64 of 24: out of memory, bisected, the cap learned
    assert not learning[0][2] and streams.stats["oom_count"] >= 1
    assert loop.former.max_padded is not None and loop.former.max_padded <= FITS
    assert loop.row_cap.cap == 16  # rows alone are not what ran out
    long = run(8, 8)
    short = run(2, 16)
    assert all(fits for _, _, fits in long + short), (long, short)
    assert max(rows for rows, _, _ in short) > 2 * max(rows for rows, _, _ in long)
