"""Every executed inference batch as a Celery task, for Flower.

An inference process tells :func:`make_batch_events`'s listener of each batch (a
:class:`workers.batch_report.BatchReport`). The listener only appends to a bounded deque
(no lock, no I/O on the hot path); a daemon thread drains it every ``FLUSH_S`` and sends
each batch as a task named ``conveyor.batch[<model>]`` from the Celery worker's node
name, in the three events a Celery worker sends for a task it runs: ``task-received``
(when the process read the batch's first request), ``task-started`` (when the batch went
into the model) and ``task-succeeded``, or ``task-failed`` with the error when any of
its requests was answered with one (the model raised, say). All of one flush go in one
Redis pipeline. Flower then shows each batch's outcome, its received and started times,
the worker's processed, succeeded and failed counts, and its Prometheus metrics
(``flower_events_total``, ``flower_task_runtime_seconds``).

Events are for watching, never a cost. Celery builds each event in Python (about 0.2 ms
of CPU each, pipelined), so at most ``batch_events_per_s`` events go out a second per
process: past that, the rest of a flush is merged into one task per outcome, whose
``kwargs`` say how many batches it stands for and whose result (or error) begins
``"<n> batches merged"``. When the deque is full the oldest are dropped; while Redis is
unreachable the thread backs off and drops them. ``CONVEYOR_BATCH_EVENTS_PER_S=0`` sends
none.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from batching.backoff import Backoff
from batching.settings import Settings
from conveyor.celery_client import celery_app
from workers.batch_report import BatchListener, BatchReport

log = logging.getLogger("conveyor.events")

NODE_ENV = "CONVEYOR_CELERY_NODE"
"""Set by the worker's bootstep to its Celery node name; inference processes inherit it."""
FLUSH_S = 0.25
QUEUE_LIMIT = 10_000
BACKOFF_S = (0.5, 10.0)
EVENTS_PER_TASK = 3
"""task-received, task-started, and task-succeeded or task-failed."""


def task_name(model: str) -> str:
    return f"conveyor.batch[{model}]"


def make_batch_events(model: str, settings: Settings) -> BatchListener:
    """Start the sender thread; return the listener for ``InferenceLoop.events``."""
    if settings.batch_events_per_s <= 0:
        return _silent
    sender = BatchEvents(model, settings)
    sender.start()
    return sender.record


def _silent(report: BatchReport) -> None:
    """The listener when batch events are off."""


@dataclass(frozen=True, slots=True)
class BatchTask:
    """One task as Flower shows it: a batch, or several merged."""

    batches: int
    rows: int
    reason: str
    received: float
    started: float
    answered: float
    runtime: float
    """Seconds in the model and answering; of merged batches, their mean."""
    error: str

    @property
    def kwargs(self) -> str:
        return orjson.dumps({"rows": self.rows, "batches": self.batches,
                             "reason": self.reason}).decode()

    @property
    def label(self) -> str:
        """How a merged task begins its result or error."""
        return f"{self.batches} batches merged" if self.batches > 1 else ""

    @property
    def result(self) -> str:
        if self.label:
            return f"{self.label}: {self.rows} rows, mean runtime {self.runtime * 1000:.1f} ms"
        return orjson.dumps({"rows": self.rows, "reason": self.reason}).decode()

    @property
    def exception(self) -> str:
        return f"{self.label}, each failed; the first: {self.error}" if self.label else self.error


def plan(reports: Sequence[BatchReport], most: int) -> list[BatchTask]:
    """The tasks ``reports`` are shown as: one each while they number at most ``most``;
    past that the first ``most - 2`` one each and the rest merged, the failed apart from
    the others (so at most ``most`` tasks, at least two)."""
    if len(reports) <= most:
        return [_task([r]) for r in reports]
    cut = max(0, most - 2)
    rest = reports[cut:]
    groups = [[r for r in rest if r.error], [r for r in rest if not r.error]]
    return [_task([r]) for r in reports[:cut]] + [_task(g) for g in groups if g]


def _task(reports: Sequence[BatchReport]) -> BatchTask:
    first = reports[0]
    if len(reports) == 1:
        return BatchTask(1, first.rows, first.reason, first.received, first.started,
                         first.answered, first.answered - first.started, first.error)
    return BatchTask(
        batches=len(reports), rows=sum(r.rows for r in reports), reason="merged",
        received=min(r.received for r in reports), started=min(r.started for r in reports),
        answered=max(r.answered for r in reports),
        runtime=sum(r.answered - r.started for r in reports) / len(reports),
        error=next((r.error for r in reports if r.error), ""))


class BatchEvents:
    def __init__(self, model: str, settings: Settings) -> None:
        self.name = task_name(model)
        self.per_flush = max(2, int(settings.batch_events_per_s * FLUSH_S) // EVENTS_PER_TASK)
        """Most tasks sent per flush."""
        self.hostname = os.environ.get(NODE_ENV) or f"conveyor@{socket.gethostname()}"
        self.app = celery_app(settings, "conveyor-events", current=False)
        self.app.conf.broker_connection_retry = False  # the sender drops events and backs off
        self._queue: deque[BatchReport] = deque(maxlen=QUEUE_LIMIT)
        self._thread = threading.Thread(target=self._run, name="conveyor-batch-events",
                                        daemon=True)

    def record(self, report: BatchReport) -> None:
        """The listener: O(1), thread-safe, never blocks."""
        self._queue.append(report)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        backoff = Backoff(*BACKOFF_S)
        while True:
            time.sleep(FLUSH_S)
            if not self._queue:
                continue
            try:
                with self.app.connection_for_write() as conn:
                    dispatcher = self.app.events.Dispatcher(conn, hostname=self.hostname,
                                                            buffer_while_offline=False)
                    while True:
                        with dispatcher.producer.batch():
                            self._flush(dispatcher)
                        backoff.reset()
                        time.sleep(FLUSH_S)
            except Exception as exc:  # Redis away, or anything else: drop, wait, reconnect
                self._queue.clear()
                delay = backoff.next()
                log.debug("batch events paused (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)

    def _flush(self, dispatcher: Any) -> None:
        pending = [self._queue.popleft() for _ in range(len(self._queue))]
        for task in plan(pending, self.per_flush):
            self._send(dispatcher, task)
            time.sleep(0)  # let the inference thread have the GIL between tasks

    def _send(self, dispatcher: Any, task: BatchTask) -> None:
        task_id = str(uuid.uuid4())
        dispatcher.send("task-received", uuid=task_id, name=self.name, timestamp=task.received,
                        args="[]", kwargs=task.kwargs, retries=0, eta=None, expires=None)
        dispatcher.send("task-started", uuid=task_id, timestamp=task.started)
        if task.error:
            dispatcher.send("task-failed", uuid=task_id, timestamp=task.answered,
                            runtime=task.runtime, exception=task.exception, traceback="")
        else:
            dispatcher.send("task-succeeded", uuid=task_id, timestamp=task.answered,
                            runtime=task.runtime, result=task.result)
