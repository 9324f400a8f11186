"""An in-memory dispatcher for in-process tests of the API (api.dispatch_port.DispatchPort).

Requests never reach a stream: ``submit`` records them and answers with ``answer``, the
model's stand-in, in this process. Everything the API reads or writes besides requests and
replies (heartbeats, the repository hash, statistics, jobs) goes to a fakeredis server of
its own, so a test sets the stage with plain Redis commands (:meth:`MemoryDispatcher.beat`)
instead of a fake per caller.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable

import fakeredis
import redis

from api.dispatch import Admission
from batching.envelope import Reply, Request
from batching.errors import Unavailable
from batching.keys import Keys

Answer = Callable[[Request], Reply]


def unanswered(request: Request) -> Reply:
    """The default model: none; a test that expects a request to get this far says so."""
    raise AssertionError(f"request {request.id} reached the dispatcher")


class MemoryDispatcher:
    def __init__(self, keys: Keys, answer: Answer = unanswered) -> None:
        self.keys = keys
        self.answer = answer
        self.reply_key = keys.reply("memory")
        self.redis_ok = True
        self.submitted: list[tuple[Admission, Request]] = []
        self._server = fakeredis.FakeServer()
        self.redis = fakeredis.FakeAsyncRedis(server=self._server)
        self._ids = itertools.count(1)
        self._closed = False

    def new_id(self) -> str:
        return format(next(self._ids), "x")

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self._closed = True
        await self.redis.aclose()

    async def submit(self, admission: Admission, request: Request, timeout_s: float) -> Reply:
        if self._closed:
            raise Unavailable("the API is shutting down")
        self.submitted.append((admission, request))
        return self.answer(request)

    def sync_redis(self) -> redis.Redis:
        """A blocking client on the same fake server, for a test to set the stage; close it."""
        return fakeredis.FakeRedis(server=self._server)

    def beat(self, model: str, state: str = "ready") -> None:
        """A worker heartbeat of ``model`` as an inference process writes it
        (workers/heartbeat.py): the watch then counts a worker in ``state``."""
        with self.sync_redis() as client:
            client.hset(self.keys.workers(model), "memory-worker",
                        json.dumps({"state": state, "model": model, "ts": time.time()}))
