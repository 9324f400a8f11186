"""The inference loop with model versions and without a batch dim, over in-memory streams:
each batch runs the version its requests asked for, and a request of a model with
``max_batch_size: 0`` runs alone, as it was given."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from typing import Any

import numpy as np
import numpy.typing as npt

from batching.config import BatchingConfig, ModelConfig, TensorSpec
from batching.envelope import VERSION, WHOLE, Request, Tensor
from batching.keys import Keys
from workers.inference import InferenceLoop
from workers.memory_streams import MemoryReclaimer, MemoryStreams
from workers.shared_state import SharedState

Arrays = dict[str, npt.NDArray[Any]]
KEYS = Keys("t")
REPLY = "reply:test"


class Times:
    """``y = x * factor``; records the shape of every batch it ran."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.shapes: list[tuple[int, ...]] = []

    def predict(self, inputs: Arrays) -> Arrays:
        self.shapes.append(inputs["x"].shape)
        return {"y": inputs["x"] * self.factor}


def loop_of(config: ModelConfig, models: dict[str, Times]) -> tuple[InferenceLoop, MemoryStreams]:
    streams = MemoryStreams(KEYS.queues(config.name, config.queue.priority_levels))
    newest = models[config.served_versions[-1]]
    loop = InferenceLoop(config, newest, streams, MemoryReclaimer(streams),
                         SharedState(multiprocessing.get_context("spawn")), KEYS,
                         versions=models)
    return loop, streams


def request(array: npt.NDArray[Any], **params: Any) -> Request:
    now_ms = int(time.time() * 1000)
    return Request(uuid.uuid4().hex, REPLY, now_ms + 60_000, now_ms, 1,
                   [Tensor.from_array("x", array)], params=params)


def test_each_batch_runs_the_version_its_requests_asked_for() -> None:
    config = ModelConfig("v", "python", 8, inputs=(TensorSpec("x", "FP32", (-1, 2)),),
                         batching=BatchingConfig(0, adaptive=False), versions=("1", "2"))
    models = {"1": Times(1.0), "2": Times(2.0)}
    loop, streams = loop_of(config, models)
    ones = np.ones((1, 2), np.float32)
    sent = [request(ones, **{VERSION: "1"}), request(ones, **{VERSION: "2"}),
            request(ones, **{VERSION: "1"}), request(ones), request(ones, **{VERSION: "7"})]
    for each in sent:
        streams.put(each)
    for _ in range(5):
        loop.step()
    got = {reply.id: reply for reply in streams.replies(REPLY)}
    values = [got[each.id].outputs[0].array()[0, 0] if got[each.id].ok else None
              for each in sent]
    assert values == [1.0, 2.0, 1.0, 2.0, None], "no version: the newest served"
    assert got[sent[-1].id].error_code == "unavailable"
    assert "version 7 is not loaded by this process" in got[sent[-1].id].error
    # A request naming no version (a job's chunk) runs on the newest, in its own batch.
    assert models["1"].shapes == [(2, 2)] and models["2"].shapes == [(1, 2), (1, 2)]
    assert streams.rows_waiting == 0


def test_a_request_without_a_batch_dim_runs_alone_with_its_shapes() -> None:
    config = ModelConfig("w", "python", 0, inputs=(TensorSpec("x", "FP32", (3, 2)),),
                         batching=BatchingConfig(adaptive=False))
    model = Times(3.0)
    loop, streams = loop_of(config, {"1": model})
    sent = [request(np.full((3, 2), i, np.float32), **{WHOLE: 1}) for i in range(3)]
    for each in sent:
        streams.put(each)
    for _ in range(3):
        loop.step()
    assert model.shapes == [(3, 2)] * 3
    got = {reply.id: reply for reply in streams.replies(REPLY)}
    for i, each in enumerate(sent):
        np.testing.assert_array_equal(got[each.id].outputs[0].array(),
                                      np.full((3, 2), 3.0 * i, np.float32))
    assert streams.rows_waiting == 0
