"""The API process's one link to Redis for requests and replies.

Writes are coalesced: every request submitted during one event-loop tick goes out in
one pipeline. Replies come back on one list per API process (``cv:reply:{api_id}``),
popped in bulk by a single reader task that resolves each request's future.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from batching.envelope import FIELD, Reply, Request
from batching.errors import DeadlineExceeded, Unavailable
from batching.keys import Keys

log = logging.getLogger(__name__)

REPLY_BATCH = 1024
"""Replies popped per round trip."""


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
        self._outbox: list[tuple[str, bytes, asyncio.Future[Reply]]] = []
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

    async def submit(self, stream: str, request: Request, timeout_s: float) -> Reply:
        """Append ``request`` to ``stream`` and wait for its reply until ``timeout_s``."""
        if not self.redis_ok:
            raise Unavailable("Redis is unreachable")
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[request.id] = fut
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append((stream, request.encode(), fut))
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

    async def _write(self, batch: list[tuple[str, bytes, asyncio.Future[Reply]]]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for stream, data, _ in batch:
            pipe.xadd(stream, {FIELD: data})
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:
            self._mark_down(exc)
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(Unavailable(f"Redis is unreachable: {exc}"))

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

    def _resolve(self, reply: Reply) -> None:
        fut = self._waiting.get(reply.id)
        if fut is not None and not fut.done():
            fut.set_result(reply)
