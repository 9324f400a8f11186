"""The inference loop driven step by step over in-memory streams: no Redis, no process.

Each test puts requests into :class:`MemoryStreams`, calls ``loop.step()`` and reads the
replies back; a tiny model in the test records the batches it ran and fails on demand.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from batching.config import BatchingConfig, ModelConfig, TensorSpec
from batching.envelope import Reply, Request, Tensor
from batching.keys import Keys
from workers.inference import InferenceLoop
from workers.memory_streams import MemoryReclaimer, MemoryStreams
from workers.shared_state import SharedState

Arrays = dict[str, npt.NDArray[Any]]
MODEL = "tiny"
KEYS = Keys("t")
REPLY = "reply:test"


class DeviceOutOfMemory(RuntimeError):
    """An allocation failure as onnxruntime raises it: ``is_out_of_memory`` knows it by its
    module, so the test needs neither torch nor a device."""


DeviceOutOfMemory.__module__ = "onnxruntime.capi.onnxruntime_pybind11_state"


class Tiny:
    """Doubles ``x`` and reports each batch's rows; records what it ran and what the
    streams had on trial meanwhile; raises what ``fail(rows)`` returns."""

    def __init__(self, streams: MemoryStreams) -> None:
        self.streams = streams
        self.batches: list[int] = []
        self.suspects: list[str | None] = []
        self.fail: Callable[[int], Exception | None] = lambda rows: None

    def predict(self, inputs: Arrays) -> Arrays:
        x = inputs["x"]
        rows = x.shape[0]
        self.batches.append(rows)
        self.suspects.append(self.streams.suspect)
        error = self.fail(rows)
        if error is not None:
            raise error
        return {"y": x * 2, "batch_rows": np.full((rows, 1), rows, np.int64)}


def make_loop(max_batch_size: int = 8) -> tuple[InferenceLoop, MemoryStreams, Tiny]:
    config = ModelConfig(
        MODEL, "python", max_batch_size,
        inputs=(TensorSpec("x", "FP32", (-1, 4)),),
        outputs=(TensorSpec("y", "FP32", (-1, 4)), TensorSpec("batch_rows", "INT64", (-1, 1))),
        batching=BatchingConfig(max_queue_delay_us=0, adaptive=False))
    streams = MemoryStreams(KEYS.queues(MODEL, config.queue.priority_levels))
    model = Tiny(streams)
    loop = InferenceLoop(config, model, streams, MemoryReclaimer(streams),
                         SharedState(multiprocessing.get_context("spawn")), KEYS)
    return loop, streams, model


def request(value: float, rows: int = 1, *, deadline_ms: int | None = None) -> Request:
    now_ms = int(time.time() * 1000)
    x = Tensor.from_array("x", np.full((rows, 4), value, np.float32))
    return Request(uuid.uuid4().hex, REPLY, deadline_ms or now_ms + 60_000, now_ms, 1, [x])


def replies(streams: MemoryStreams) -> dict[str, Reply]:
    return {reply.id: reply for reply in streams.replies(REPLY)}


def output(reply: Reply, name: str) -> npt.NDArray[Any]:
    return next(t.array() for t in reply.outputs if t.name == name)


def test_requests_read_together_run_as_one_batch_and_each_gets_its_own_rows() -> None:
    loop, streams, model = make_loop()
    sent = [request(1.0), request(2.0, rows=2), request(3.0)]
    for each in sent:
        streams.put(each)
    loop.step()
    assert model.batches == [4]
    got = replies(streams)
    for each in sent:
        reply = got[each.id]
        assert reply.ok and reply.batch_rows == 4
        np.testing.assert_array_equal(output(reply, "y"), each.inputs[0].array() * 2)
        assert output(reply, "batch_rows").tolist() == [[4]] * each.rows
    assert streams.rows_waiting == 0
    assert (streams.stats["execution_count"], streams.stats["inference_count"],
            streams.stats["success_count"], streams.stats["reason:window"]) == (1, 4, 3, 1)
    assert (loop.batches, loop.rows) == (1, 4)
    assert isinstance(loop.reclaimer, MemoryReclaimer)
    assert len(loop.reclaimer.batch_seconds) == 1


def test_an_expired_entry_is_answered_deadline_exceeded_and_never_runs() -> None:
    loop, streams, model = make_loop()
    expired, live = request(1.0, deadline_ms=int(time.time() * 1000) - 1), request(2.0)
    streams.put(expired)
    streams.put(live)
    loop.step()
    got = replies(streams)
    assert got[expired.id].error_code == "deadline_exceeded"
    assert got[live.id].ok
    assert model.batches == [1]
    assert streams.stats["fail_count"] == 1 and streams.rows_waiting == 0


def test_a_model_error_fails_every_request_of_its_batch_and_the_loop_goes_on() -> None:
    loop, streams, model = make_loop()
    model.fail = lambda rows: ValueError("bad weights")
    first, second = request(1.0), request(2.0)
    streams.put(first)
    streams.put(second)
    loop.step()
    got = replies(streams)
    for each in (first, second):
        assert got[each.id].error_code == "model_failure"
        assert "bad weights" in got[each.id].error
    model.fail = lambda rows: None
    after = request(3.0)
    streams.put(after)
    loop.step()
    assert replies(streams)[after.id].ok
    assert model.batches == [2, 1] and streams.rows_waiting == 0


def test_a_redelivered_entry_runs_alone_on_trial_and_its_answer_clears_the_trial() -> None:
    loop, streams, model = make_loop()
    # one deadline for all: the order is then the reading order (reclaimed first), not
    # which millisecond each request happened to be made in
    deadline_ms = int(time.time() * 1000) + 60_000
    fresh = [request(1.0, deadline_ms=deadline_ms), request(2.0, deadline_ms=deadline_ms)]
    for each in fresh:
        streams.put(each)
    redelivered = request(9.0, deadline_ms=deadline_ms)
    entry_id = streams.put(redelivered, deliveries=2)
    loop.step()
    assert model.batches == [1] and model.suspects == [entry_id]
    assert streams.suspect is None
    assert replies(streams)[redelivered.id].ok
    loop.step()  # its former neighbours run together, with nothing on trial
    assert model.batches == [1, 2] and model.suspects == [entry_id, None]
    assert set(replies(streams)) == {each.id for each in fresh}
    assert streams.stats["reclaimed_count"] == 1


def test_an_entry_delivered_more_than_max_deliveries_is_dead_lettered_not_run() -> None:
    loop, streams, model = make_loop()
    limit = loop.config.max_deliveries
    last_chance, poison = request(1.0), request(2.0)
    streams.put(last_chance, deliveries=limit)
    streams.put(poison, deliveries=limit + 1)
    loop.step()
    [(entry, reason)] = streams.dead_letters[KEYS.dead_letter(MODEL)]
    assert entry.request.id == poison.id and f"failed {limit} times" in reason
    got = replies(streams)
    assert got[poison.id].error_code == "model_failure"
    assert "dead-letter" in got[poison.id].error
    assert got[last_chance.id].ok and model.batches == [1]
    assert streams.stats["dead_letter_count"] == 1 and streams.rows_waiting == 0


def test_out_of_memory_halves_the_batch_and_the_row_cap_and_bisects_a_large_request() -> None:
    loop, streams, model = make_loop()
    model.fail = lambda rows: DeviceOutOfMemory("Failed to allocate memory") if rows > 2 else None
    small = [request(float(i)) for i in range(4)]
    for each in small:
        streams.put(each)
    loop.step()
    assert model.batches == [4, 2, 2]
    assert all(reply.ok and reply.batch_rows == 2 for reply in replies(streams).values())
    assert loop.row_cap.cap == loop.policy.row_cap == loop.shared.row_cap == 2
    assert streams.stats["oom_count"] == 1
    large = request(5.0, rows=4)  # one request above the cap runs alone, split by rows
    streams.put(large)
    loop.step()
    assert model.batches[-2:] == [2, 2]
    reply = replies(streams)[large.id]
    assert reply.ok and output(reply, "y").shape == (4, 4)


def test_run_time_control_lowers_and_restores_the_batch_size_bound() -> None:
    loop, streams, model = make_loop(max_batch_size=8)
    loop.apply_control({"max_batch_size": 2})
    assert loop.stats()["max_batch_size"] == 2 and loop.policy.row_cap == 2
    for i in range(5):
        streams.put(request(float(i)))
    loop.step()
    assert model.batches == [2] and len(loop.former) == 0  # read no more than the bound
    loop.step()
    loop.step()
    assert model.batches == [2, 2, 1]
    loop.apply_control({"max_batch_size": 100})  # restored, never above the configured 8
    assert loop.stats()["max_batch_size"] == 8
    for i in range(5):
        streams.put(request(float(i)))
    loop.step()
    # Reads up to the restored bound at once; the learned cap grows back by probing, as
    # after an out-of-memory error.
    assert model.batches[3:] == [2] and len(loop.former) == 3
    assert loop.stats()["row_cap"] == 2


def test_run_time_control_changes_the_window() -> None:
    loop, streams, model = make_loop()
    loop.apply_control({"max_queue_delay_us": 10_000_000})
    assert loop.stats()["max_queue_delay_us"] == 10_000_000
    streams.put(request(1.0))
    loop.step()
    assert model.batches == [] and len(loop.former) == 1  # the window is open
    loop.apply_control({"max_queue_delay_us": 0})
    loop.step()
    assert model.batches == [1]


def test_the_rows_counter_is_reconciled_at_the_first_step_and_after_a_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    loop, streams, _ = make_loop()
    streams.put(request(1.0))
    streams.rows_waiting = 40  # drifted
    loop.step()
    assert streams.rows_waiting == 0
    streams.rows_waiting = 12
    loop.step()
    assert streams.rows_waiting == 12  # not due again for a while

    def unreachable(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Redis went away")

    monkeypatch.setattr(streams, "read", unreachable)
    with pytest.raises(ConnectionError):
        loop.step()
    monkeypatch.undo()
    loop.step()
    assert streams.rows_waiting == 0
