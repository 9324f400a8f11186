"""The API's lean Redis connections: an asyncio protocol speaking pipelined RESP.

Each command's reply is handed to the callback written with it, first in, first out,
straight from ``data_received``: no task switch, no connection pool, about 15 µs of
Python a command instead of redis-py's 100 (docs/data-path.md section 7).
Used for the two per-request commands, admission and reply popping; everything else
stays on redis-py.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from batching.resp import Address, Command, RespError, check, encode_all, new_reader

ReplyHandler = Callable[[Any], None]
"""Called with the reply, a :class:`RespError`, or the ``ConnectionError`` of a lost link."""


class Link(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader: Any = new_reader()
        self._handlers: deque[ReplyHandler] = deque()
        self._transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while True:
            try:
                reply = self._reader.gets()
            except Exception as exc:  # hiredis.ProtocolError: nothing more can be trusted
                self.abort()
                self.connection_lost(exc)
                return
            if reply is False:
                return
            self._handlers.popleft()(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        error = ConnectionError(f"lost the connection to Redis{f': {exc}' if exc else ''}")
        while self._handlers:
            self._handlers.popleft()(error)
        if not self.closed.done():
            self.closed.set_result(None)

    @property
    def open(self) -> bool:
        return self._transport is not None

    def write(self, data: bytes, handlers: list[ReplyHandler]) -> None:
        """Send encoded commands; ``handlers`` (one per command) receive their replies."""
        if self._transport is None:
            error = ConnectionError("not connected to Redis")
            for handler in handlers:
                handler(error)
            return
        self._handlers.extend(handlers)
        self._transport.write(data)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    async def execute(self, *commands: Command) -> list[Any]:
        """Send ``commands`` and await their replies; error replies raise."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in commands]
        self.write(encode_all(commands), [_resolver(f) for f in futures])
        return [check(reply) for reply in await asyncio.gather(*futures)]


def _resolver(future: asyncio.Future[Any]) -> ReplyHandler:
    def resolve(reply: Any) -> None:
        if future.done():
            return
        if isinstance(reply, OSError):
            future.set_exception(reply)
        else:
            future.set_result(reply)
    return resolve


async def open_link(address: Address, timeout_s: float = 1.0) -> Link:
    """Connect, log in (AUTH, SELECT) and return the link; raises ``OSError`` or
    :class:`RespError`."""
    loop = asyncio.get_running_loop()
    if address.path is not None:
        connecting = loop.create_unix_connection(Link, address.path)
    else:
        connecting = loop.create_connection(
            Link, address.host, address.port,
            ssl=address.ssl_context())
    _, link = await asyncio.wait_for(connecting, timeout_s)
    login = address.login()
    try:
        if login:
            await asyncio.wait_for(link.execute(*login), timeout_s)
    except (OSError, RespError, TimeoutError):
        link.abort()
        raise
    return link
