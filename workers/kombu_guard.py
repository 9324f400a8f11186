"""A closed broker connection reads as the connection error it is, not a crash.

kombu's Redis channel builds a client from ``self.connection.client``, which is None once
its connection has closed (kombu 5.x, ``Channel._connparams``). A late ack of a task that
finished while the broker failed over reached exactly that: an ``AttributeError`` that
Celery's consumer does not expect, so the whole worker stopped ("Unrecoverable error").
Celery guards a late ack against the transport's connection errors, so here it becomes a
``ConnectionError``: the ack is logged as failed and the worker carries on. The message
was restored when the connection dropped and is delivered again; a job's lease makes the
second delivery harmless (workers/job_tasks.py).
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis

_MARK = "_conveyor_guarded"


def install() -> None:
    """Guard ``Channel._connparams`` (the Sentinel channel inherits it); idempotent."""
    channel: Any = kombu_redis.Channel
    original = channel._connparams
    if getattr(original, _MARK, False):
        return

    def connparams(self: Any, asynchronous: bool = False) -> Any:
        if self.connection is None or self.connection.client is None:
            raise ConnectionError("the channel's broker connection is closed")
        return original(self, asynchronous)

    setattr(connparams, _MARK, True)
    channel._connparams = connparams
