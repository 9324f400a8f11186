"""A lone request (its API process had nothing else in flight) runs on every core; any
other batch runs with the reserved cores left out (workers.backends.EveryCore), driven
through the inference loop over in-memory streams."""

from __future__ import annotations

import numpy as np

from tests.unit.test_inference_loop import Arrays, make_loop, replies, request
from workers.every_core import EveryCore
from workers.inference import InferenceLoop
from workers.memory_streams import MemoryStreams


class Recorder:
    def __init__(self) -> None:
        self.batches: list[int] = []

    def predict(self, inputs: Arrays) -> Arrays:
        x = inputs["x"]
        self.batches.append(x.shape[0])
        return {"y": x * 2, "batch_rows": np.full((x.shape[0], 1), x.shape[0], np.int64)}


def _loop() -> tuple[Recorder, Recorder, InferenceLoop, MemoryStreams]:
    loop, streams, _ = make_loop()
    reserved, every = Recorder(), Recorder()
    loop.model = EveryCore(reserved, every)
    loop.runner.model = loop.model
    return reserved, every, loop, streams


def test_a_lone_request_runs_on_every_core() -> None:
    reserved, every, loop, streams = _loop()
    lone = request(1.0)
    lone.params["lone"] = 1
    streams.put(lone)
    loop.step()
    assert (every.batches, reserved.batches) == ([1], [])
    assert replies(streams)[lone.id].ok


def test_other_batches_leave_the_reserved_cores() -> None:
    reserved, every, loop, streams = _loop()
    plain = request(1.0)  # its API process had others in flight: not lone
    streams.put(plain)
    loop.step()
    two = [request(2.0), request(3.0)]
    for each in two:
        each.params["lone"] = 1  # two lone requests of two API processes share a batch
        streams.put(each)
    loop.step()
    assert (reserved.batches, every.batches) == ([1, 2], [])
    got = replies(streams)
    assert all(got[each.id].ok for each in [plain, *two])
