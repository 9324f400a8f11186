"""Requests whose clients left are dropped unrun: the loop over in-memory streams."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from typing import Any

import numpy as np
import numpy.typing as npt

from batching.config import BatchingConfig, ModelConfig, TensorSpec
from batching.envelope import Reply, Request, Tensor
from batching.keys import Keys
from workers.inference import InferenceLoop
from workers.memory_streams import MemoryReclaimer, MemoryStreams
from workers.shared_state import SharedState

KEYS = Keys("t")
REPLY = "reply:test"


class Recorder:
    """Doubles ``x``; records the first value of every row it ran."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def predict(self, inputs: dict[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        self.seen += inputs["x"][:, 0].tolist()
        return {"y": inputs["x"] * 2}


def request(value: float) -> Request:
    now_ms = int(time.time() * 1000)
    return Request(uuid.uuid4().hex, REPLY, now_ms + 60_000, now_ms, 2,
                   [Tensor.from_array("x", np.full((1, 4), value, np.float32))])


def test_entries_whose_clients_left_never_run_and_are_counted() -> None:
    config = ModelConfig("m", "python", 8, inputs=(TensorSpec("x", "FP32", (-1, 4)),),
                         outputs=(TensorSpec("y", "FP32", (-1, 4)),),
                         batching=BatchingConfig(max_queue_delay_us=10_000_000, adaptive=False))
    streams = MemoryStreams(KEYS.queues("m", config.queue.priority_levels))
    model = Recorder()
    loop = InferenceLoop(config, model, streams, MemoryReclaimer(streams),
                         SharedState(multiprocessing.get_context("spawn")), KEYS)
    kept, read_then_left = streams.put(request(1)), streams.put(request(2))
    loop.step()  # both read; the window holds them
    assert len(loop.former) == 2 and model.seen == []
    streams.leave(read_then_left)  # held by the loop: marked
    unread = streams.put(request(3))
    streams.leave(unread)  # never read: deleted at once
    loop.step()
    assert len(loop.former) == 1
    loop.stopping = True
    loop.step()
    assert model.seen == [1.0]
    answered = [Reply.decode(blob) for blob in streams.lists[REPLY]]
    assert len(answered) == 1 and answered[0].ok
    assert streams.stats["withdrawn_count"] == 2
    assert streams.rows_waiting == 0 and streams.rows_in_streams() == 0
    assert kept not in streams.withdrawn
