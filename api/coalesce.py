"""One write per response: an HTTP connection's transport that holds a response's head
until its body follows.

uvicorn writes a response's status line and headers, then its body, as two
``transport.write`` calls, and uvloop sends each at once: two ``send`` system calls and
two TCP segments per response, where one would do. :class:`CoalescingTransport` holds a
write that is a complete response head and sends it together with the next write, the
body, which the application sends in the same event-loop turn. A head with nothing after
it (no body, or one that comes later) is sent at the end of that turn, or before the
connection closes.
"""

from __future__ import annotations

import asyncio
from typing import Any

HEAD_START = b"HTTP/1.1 "
HEAD_END = b"\r\n\r\n"
INTERIM = b"HTTP/1.1 1"
"""An interim response (``100 Continue``) goes at once: the client waits for it to send."""


class CoalescingTransport:
    """``transport`` with response heads held for one event-loop turn; everything but
    ``write`` and ``close`` is the transport's own."""

    __slots__ = ("_head", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif (data.startswith(HEAD_START) and data.endswith(HEAD_END)
              and not data.startswith(INTERIM)):
            self._head = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Send a held head now."""
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
