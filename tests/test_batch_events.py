"""Batch events as Flower reads them: each batch's outcome, times and merging.

The events :class:`workers.events.BatchEvents` sends are fed to Flower's own event state
(what its tasks and workers pages show), in this process: no Redis, no Flower server.
tests/test_flower_control.py checks the same through a real stack and a real Flower.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery.events import Event
from flower.events import EventsState

from batching.envelope import Reply, Request
from batching.former import Entry
from batching.settings import Settings
from workers.batch_report import BatchReport, failure
from workers.events import BatchEvents, plan

WORKER = "worker-1@host"


class Recorder:
    """Stands in for Celery's event dispatcher: keeps each event as a monitor receives it."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def send(self, type_: str, **fields: Any) -> None:
        self.events.append(Event(type_, hostname=WORKER, clock=len(self.events) + 1,
                                 local_received=time.time(), **fields))


def shown(reports: list[BatchReport], per_s: int = 100) -> tuple[EventsState, Recorder]:
    """Flower's state after ``reports`` went out in one flush."""
    sender = BatchEvents("echo", Settings(batch_events_per_s=per_s))
    recorder = Recorder()
    for report in reports:
        sender.record(report)
    sender._flush(recorder)
    state = EventsState()
    for event in recorder.events:
        state.event(dict(event))
    return state, recorder


def report(at: float, rows: int = 4, error: str = "") -> BatchReport:
    return BatchReport(rows, "full", received=at, started=at + 0.01, answered=at + 0.03,
                       error=error)


def test_a_failed_batch_is_a_failure_with_its_error_and_its_times() -> None:
    t0 = time.time() - 10
    state, recorder = shown([report(t0), report(t0 + 1, error="model_failure: it broke")])
    assert [e["type"] for e in recorder.events] == [
        "task-received", "task-started", "task-succeeded",
        "task-received", "task-started", "task-failed"]
    tasks = sorted(state.tasks.values(), key=lambda t: t.received)
    assert [t.state for t in tasks] == ["SUCCESS", "FAILURE"]
    failed = tasks[1]
    assert failed.name == "conveyor.batch[echo]" and failed.worker.hostname == WORKER
    assert failed.exception == "model_failure: it broke"
    assert (failed.received, failed.started, failed.failed) == (t0 + 1, t0 + 1.01, t0 + 1.03)
    assert failed.runtime == pytest.approx(0.02)
    # The workers page: processed (task-received), succeeded and failed, per worker.
    counts = state.counter[WORKER]
    assert (counts["task-received"], counts["task-succeeded"], counts["task-failed"]) == (2, 1, 1)


def test_batches_past_the_budget_are_merged_and_say_how_many() -> None:
    t0 = time.time() - 10
    reports = [report(t0 + i, rows=i + 1, error="model_failure: no" if i in (7, 9) else "")
               for i in range(10)]
    # 40 events a second: 10 a flush, 3 tasks (of 3 events each).
    state, recorder = shown(reports, per_s=40)
    assert len(recorder.events) == 9
    tasks = {t.kwargs: t for t in state.tasks.values()}
    one = tasks['{"rows":1,"batches":1,"reason":"full"}']
    assert one.state == "SUCCESS" and one.result == '{"rows":1,"reason":"full"}'
    ok = tasks['{"rows":36,"batches":7,"reason":"merged"}']  # rows 2..7, 9 (i = 1..6, 8)
    assert ok.state == "SUCCESS"
    assert ok.result == "7 batches merged: 36 rows, mean runtime 20.0 ms"
    assert (ok.received, ok.started) == (t0 + 1, t0 + 1.01)
    bad = tasks['{"rows":18,"batches":2,"reason":"merged"}']  # rows 8 and 10
    assert bad.state == "FAILURE"
    assert bad.exception == "2 batches merged, each failed; the first: model_failure: no"
    assert state.counter[WORKER]["task-failed"] == 1


def test_the_plan_keeps_at_most_its_budget_and_every_row() -> None:
    reports = [report(float(i), rows=1, error="e" if i % 3 == 0 else "") for i in range(50)]
    for most in (2, 3, 8, 50):
        tasks = plan(reports, most)
        assert len(tasks) <= most
        assert sum(t.batches for t in tasks) == 50 and sum(t.rows for t in tasks) == 50
        assert sum(t.batches for t in tasks if t.error) == 17


def entry(name: str) -> Entry:
    return Entry("s", "1-0", Request(id=name, reply="r", deadline_ms=0, enq_ms=0, prio=1, inputs=[]),
                 seen=0.0)


def test_failure_says_how_many_requests_of_the_batch_failed() -> None:
    ok = Reply("a")
    bad = Reply("b", error_code="model_failure", error="model 'm' failed: ValueError: x")
    assert failure([(entry("a"), ok), (entry("b"), ok)]) == ""
    assert failure([(entry("b"), bad)]) == "model_failure: model 'm' failed: ValueError: x"
    assert failure([(entry("a"), ok), (entry("b"), bad), (entry("c"), bad)]) == (
        "2 of 3 requests failed, the first with model_failure: model 'm' failed: ValueError: x")
