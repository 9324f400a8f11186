"""A test's body run against the API's Redis side alone: an ``api.dispatch.Dispatcher``
started on a test's redis-server and a plain redis.asyncio client of the same server, for
the test to stand in for the worker (tests/test_dispatch.py, tests/test_large_admission.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from api.dispatch import Dispatcher
from batching.keys import Keys
from tests.procs import RedisServer

Body = Callable[[Dispatcher, aioredis.Redis], Awaitable[None]]

CONNECT_S = 10.0
"""How long the dispatcher's writer link may take to open (a busy host) before the body
runs regardless."""


def run_dispatcher(server: RedisServer, keys: Keys, body: Body, *, busy_poll_s: float = 0.0,
                   lean: bool = True) -> None:
    """Delete what an earlier test left under ``keys``' prefix, start a Dispatcher under
    ``keys`` (``busy_poll_s`` and ``lean`` as its own), wait for its writer link, run
    ``body``; close the dispatcher and the client whatever happens."""
    async def main() -> None:
        dispatcher = Dispatcher(server.url, keys, busy_poll_s, lean)
        client = aioredis.Redis.from_url(server.url)
        left = [key async for key in client.scan_iter(match=f"{keys.prefix}:*")]
        if left:
            await client.delete(*left)
        await dispatcher.start()
        try:
            deadline = time.monotonic() + CONNECT_S
            while dispatcher._writer is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await body(dispatcher, client)
        finally:
            await dispatcher.close()
            await client.aclose()
    asyncio.run(main())
