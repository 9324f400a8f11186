"""Every executed inference batch as a Celery task event, for Flower.

An inference process tells :func:`make_batch_events`'s listener of each batch: rows,
seconds, reason. The listener only appends to a bounded deque (no lock, no I/O on the
hot path); a daemon thread drains it every ``FLUSH_S`` and sends one ``task-succeeded``
event per batch, named ``conveyor.batch[<model>]``, with ``runtime`` and ``rows``, from
the Celery worker's node name, all of one flush in one Redis pipeline. Flower's tasks
view and its Prometheus metrics (``flower_events_total``, ``flower_task_runtime_seconds``)
then show live batch activity.

Events are for watching, never a cost. Celery builds each event in Python (about 0.2 ms
of CPU each, pipelined), so at most ``batch_events_per_s`` go out a second per process:
past that, the rest of a flush is merged into one event (``batches`` says how many).
When the deque is full the oldest are dropped; while Redis is unreachable the thread
backs off and drops them. ``CONVEYOR_BATCH_EVENTS_PER_S=0`` sends none.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from typing import Any

import orjson

from batching.backoff import Backoff
from batching.settings import Settings
from conveyor.celery_client import celery_app
from workers.inference import BatchListener

log = logging.getLogger("conveyor.events")

NODE_ENV = "CONVEYOR_CELERY_NODE"
"""Set by the worker's bootstep to its Celery node name; inference processes inherit it."""
FLUSH_S = 0.25
QUEUE_LIMIT = 10_000
BACKOFF_S = (0.5, 10.0)


def task_name(model: str) -> str:
    return f"conveyor.batch[{model}]"


def make_batch_events(model: str, settings: Settings) -> BatchListener:
    """Start the sender thread; return the listener for ``InferenceLoop.events``."""
    if settings.batch_events_per_s <= 0:
        return _silent
    sender = BatchEvents(model, settings)
    sender.start()
    return sender.record


def _silent(rows: int, seconds: float, reason: str) -> None:
    """The listener when batch events are off."""


class BatchEvents:
    def __init__(self, model: str, settings: Settings) -> None:
        self.name = task_name(model)
        self.per_flush = max(1, int(settings.batch_events_per_s * FLUSH_S))
        self.hostname = os.environ.get(NODE_ENV) or f"conveyor@{socket.gethostname()}"
        self.app = celery_app(settings, "conveyor-events", current=False)
        self.app.conf.broker_connection_retry = False  # the sender drops events and backs off
        self._queue: deque[tuple[float, int, float, str]] = deque(maxlen=QUEUE_LIMIT)
        self._thread = threading.Thread(target=self._run, name="conveyor-batch-events",
                                        daemon=True)

    def record(self, rows: int, seconds: float, reason: str) -> None:
        """The listener: O(1), thread-safe, never blocks."""
        self._queue.append((time.time(), rows, seconds, reason))

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
        if not pending:
            return
        cut = len(pending) if len(pending) <= self.per_flush else self.per_flush - 1
        single, merged = pending[:cut], pending[cut:]
        for ts, rows, seconds, reason in single:
            self._send(dispatcher, ts, rows, seconds, {"rows": rows, "reason": reason})
            time.sleep(0)  # let the inference thread have the GIL between events
        if merged:
            rows = sum(m[1] for m in merged)
            mean = sum(m[2] for m in merged) / len(merged)
            self._send(dispatcher, merged[-1][0], rows, mean,
                       {"rows": rows, "batches": len(merged), "reason": "merged"})

    def _send(self, dispatcher: Any, ts: float, rows: int, seconds: float,
              info: dict[str, Any]) -> None:
        text = orjson.dumps(info).decode()
        dispatcher.send("task-succeeded", uuid=str(uuid.uuid4()), name=self.name,
                        timestamp=ts, runtime=seconds, rows=rows, args="[]", kwargs=text,
                        result=text)
