"""The API process's one link to Redis for requests and replies.

Writes are coalesced: every request submitted during one event-loop tick goes out in
one pipeline. Each request is admitted by a Lua script that checks the model's rows
waiting against its limit and appends the request to its stream, atomically, so the
overload check costs no extra round trip and a rejected request writes nothing.
Replies come back on one list per API process (``cv:reply:{api_id}``), popped in bulk
by a single reader task that resolves each request's future.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import socket
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from batching.envelope import Reply, Request
from batching.errors import DeadlineExceeded, Overloaded, Unavailable
from batching.keys import Keys

log = logging.getLogger(__name__)

REPLY_BATCH = 1024
"""Replies popped per round trip."""
ADMIT_LUA = resources.files("batching").joinpath("lua/admit.lua").read_text()


@dataclass(frozen=True, slots=True)
class Admission:
    """Where a request goes and what it may cost: its stream and the model's row budget."""

    stream: str
    rows_key: str
    rows: int
    max_rows: int


class Dispatcher:
    def __init__(self, redis_url: str, keys: Keys) -> None:
        self.api_id = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.reply_key = keys.reply(self.api_id)
        self._redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=0.5,
                                              socket_timeout=2.0)
        # The blocking reader gets its own connection, so it never delays writes.
        self._reader = aioredis.Redis.from_url(redis_url, socket_connect_timeout=0.5,
                                               socket_timeout=5.0)
        self._ids = itertools.count(1)
        self._waiting: dict[str, asyncio.Future[Reply]] = {}
        self._outbox: list[tuple[Admission, bytes, asyncio.Future[Reply]]] = []
        self._admit_sha = hashlib.sha1(ADMIT_LUA.encode()).hexdigest()
        self._reader_task: asyncio.Task[None] | None = None
        self.redis_ok = True

    @property
    def redis(self) -> aioredis.Redis:
        return self._redis

    def new_id(self) -> str:
        return format(next(self._ids), "x")

    async def start(self) -> None:
        self._reader_task = asyncio.create_task(self._read_replies(), name="conveyor-replies")

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(Unavailable("the API is shutting down"))
        await self._redis.aclose()
        await self._reader.aclose()

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    async def submit(self, admission: Admission, request: Request, timeout_s: float) -> Reply:
        """Admit ``request`` to its stream and wait for its reply until ``timeout_s``.

        Raises :class:`Overloaded` if the model's queue is full, :class:`Unavailable` if
        Redis is unreachable and :class:`DeadlineExceeded` when ``timeout_s`` passes.
        """
        if not self.redis_ok:
            raise Unavailable("Redis is unreachable")
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[request.id] = fut
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append((admission, request.encode(), fut))
        try:
            return await asyncio.wait_for(fut, timeout=max(timeout_s, 0.0))
        except TimeoutError:
            raise DeadlineExceeded(
                f"no result within the request's deadline ({timeout_s * 1000:.0f} ms)"
            ) from None
        finally:
            self._waiting.pop(request.id, None)

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        asyncio.get_running_loop().create_task(self._write(batch))

    async def _write(self, batch: list[tuple[Admission, bytes, asyncio.Future[Reply]]]) -> None:
        try:
            try:
                results = await self._admit_all(batch)
            except NoScriptError:  # a new or restarted Redis: load the script once, again
                await self._redis.script_load(ADMIT_LUA)
                results = await self._admit_all(batch)
        except (RedisError, OSError) as exc:
            self._mark_down(exc)
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(Unavailable(f"Redis is unreachable: {exc}"))
            return
        for (admission, _, fut), waiting in zip(batch, results, strict=True):
            if waiting < 0 and not fut.done():
                fut.set_exception(Overloaded(
                    f"queue full: {-waiting - 1} rows waiting, limit {admission.max_rows} "
                    "(max_queue_rows)"))

    async def _admit_all(self, batch: list[tuple[Admission, bytes, asyncio.Future[Reply]]]
                         ) -> list[Any]:
        pipe = self._redis.pipeline(transaction=False)
        for admission, data, _ in batch:
            pipe.evalsha(self._admit_sha, 2, admission.rows_key, admission.stream,
                         admission.rows, admission.max_rows, data)
        return await pipe.execute()

    def _mark_down(self, exc: BaseException) -> None:
        if self.redis_ok:
            log.warning("Redis unreachable: %s", exc)
        self.redis_ok = False

    async def _read_replies(self) -> None:
        backoff = 0.05
        while True:
            try:
                popped: Any = await self._reader.execute_command(
                    "BLMPOP", 1, 1, self.reply_key, "LEFT", "COUNT", REPLY_BATCH)
            except (RedisError, OSError) as exc:
                self._mark_down(exc)
                self._fail_waiting(Unavailable(f"lost the connection to Redis: {exc}"))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if not self.redis_ok:
                log.info("Redis reachable again")
            self.redis_ok = True
            backoff = 0.05
            if popped:
                for data in popped[1]:
                    self._resolve(Reply.decode(data))

    def _fail_waiting(self, error: Unavailable) -> None:
        """Redis went away: whether waiting requests will ever be answered is unknown, so
        answer them now rather than at their deadlines."""
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(error)

    def _resolve(self, reply: Reply) -> None:
        fut = self._waiting.get(reply.id)
        if fut is not None and not fut.done():
            fut.set_result(reply)
