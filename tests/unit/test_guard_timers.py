"""The guarded HTTP protocol keeps its connection deadlines without a timer per request
(api/http_guard.py): one watchdog per connection, set again only when it would fire too
late, and a body timer only for a body that did not come with its headers."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.config import Config
from uvicorn.server import ServerState

from api.http_direct import cycle_of, write_response
from api.http_guard import ConnectionLimits, guarded_protocol

LIMITS = ConnectionLimits(keepalive_s=5.0, header_timeout_s=10.0, body_timeout_s=30.0,
                          max_connections=16)
HEAD = (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n")


class Transport:
    def __init__(self) -> None:
        self.closed = False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def timers_set(chunks_per_request: list[bytes], requests: int) -> int:
    """Timers the protocol sets while serving ``requests`` requests on one connection,
    each sent as ``chunks_per_request``."""
    async def run() -> int:
        loop = asyncio.get_running_loop()
        answered: asyncio.Queue[None] = asyncio.Queue()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            while (await receive()).get("more_body"):
                pass
            cycle = cycle_of(scope)
            assert cycle is not None and write_response(cycle, 200, [], b"{}")
            answered.put_nowait(None)

        config = Config(app, lifespan="off", proxy_headers=False)
        config.load()
        protocol = guarded_protocol(LIMITS)(config, ServerState(), {}, loop)
        protocol.connection_made(Transport())  # type: ignore[arg-type]
        count = 0
        real = loop.call_later

        def counted(*args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            nonlocal count
            count += 1
            return real(*args, **kwargs)

        loop.call_later = counted  # type: ignore[method-assign, assignment]
        try:
            for _ in range(requests):
                for chunk in chunks_per_request:
                    protocol.data_received(chunk)
                    await asyncio.sleep(0)
                await answered.get()
        finally:
            loop.call_later = real  # type: ignore[method-assign]
            protocol.connection_lost(None)
        return count

    return asyncio.run(run())


def test_a_busy_keepalive_connection_sets_no_timer_per_request() -> None:
    # The keep-alive deadline comes before the header deadline set on connecting: one
    # timer, then none while requests keep coming.
    assert timers_set([HEAD + b"{}"], 200) <= 2


def test_a_body_that_comes_after_its_headers_gets_a_timer() -> None:
    assert timers_set([HEAD, b"{}"], 20) >= 20
