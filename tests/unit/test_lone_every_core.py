"""A lone request (its API process had nothing else in flight) may run on every core; any
other batch runs with the reserved cores left out (workers.every_core.EveryCore): driven
through the inference loop over in-memory streams, and the choice between the two ways on
a clock of the test's own."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_inference_loop import Arrays, make_loop, replies, request
from workers.every_core import MEASURE, PROBE_EVERY, EveryCore
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
    loop.model = EveryCore("tiny", reserved, every)
    loop.runner.model = loop.model
    return reserved, every, loop, streams


def test_a_first_lone_request_runs_on_every_core() -> None:
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


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timed:
    """A model that takes ``ms_per_row`` of the test's clock for each row it runs."""

    def __init__(self, clock: Clock, ms_per_row: float) -> None:
        self.clock = clock
        self.ms_per_row = ms_per_row
        self.runs = 0

    def predict(self, inputs: Arrays) -> Arrays:
        self.runs += 1
        self.clock.now += self.ms_per_row / 1e3 * inputs["x"].shape[0]
        return {"y": inputs["x"]}


def _lone_batches(model: EveryCore, count: int, rows: int = 1) -> None:
    for _ in range(count):
        model.predict_lone({"x": np.zeros((rows, 4), np.float32)}, rows)


@pytest.mark.parametrize("every_ms,reserved_ms,faster", [(1.2, 2.1, "every"), (0.3, 0.2, "reserved")])
def test_lone_batches_run_the_faster_way_and_now_and_then_the_other(
        every_ms: float, reserved_ms: float, faster: str) -> None:
    """mlp_medium is faster on every core; a small model is not (more threads to wake, no
    work to share). The two ways take turns first: a warm-up and MEASURE runs each."""
    clock = Clock()
    reserved, every = Timed(clock, reserved_ms), Timed(clock, every_ms)
    model = EveryCore("m", reserved, every, clock)
    _lone_batches(model, 2 * (1 + MEASURE), rows=3)
    assert (every.runs, reserved.runs) == (1 + MEASURE, 1 + MEASURE)
    _lone_batches(model, 2 * PROBE_EVERY)
    fast, slow = (every, reserved) if faster == "every" else (reserved, every)
    assert slow.runs == 1 + MEASURE + 2  # a probe in each PROBE_EVERY lone batches
    assert fast.runs == 1 + MEASURE + 2 * PROBE_EVERY - 2


def test_a_way_that_grew_slower_is_left() -> None:
    clock = Clock()
    reserved, every = Timed(clock, 2.0), Timed(clock, 1.0)
    model = EveryCore("m", reserved, every, clock)
    _lone_batches(model, 2 * (1 + MEASURE) + 2)
    every.ms_per_row = 4.0  # the host grew busy: threads wait for cores
    _lone_batches(model, 20)
    before = every.runs, reserved.runs
    _lone_batches(model, 10)
    assert every.runs - before[0] <= 1  # a probe at most
    assert reserved.runs - before[1] >= 9


def test_two_ways_about_as_fast_do_not_take_turns() -> None:
    clock = Clock()
    reserved, every = Timed(clock, 1.0), Timed(clock, 0.97)
    model = EveryCore("m", reserved, every, clock)
    _lone_batches(model, 2 * (1 + MEASURE))  # every core is chosen, by 3%
    every.ms_per_row = 1.02  # now the reserved threads lead by 2%: not enough to turn
    _lone_batches(model, 2 * PROBE_EVERY)
    assert reserved.runs == 1 + MEASURE + 2  # its first turns, and the probes only
