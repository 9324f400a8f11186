"""A pipelined request's body is timed from when its request starts, not from when its
headers arrived behind a slow one (api/http_guard.py): the listener reads nothing more
from the connection while the first is served, so its body could not have come."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from api.http_guard import ConnectionLimits
from tests.guarded_server import guarded_server, responses, send_whole

BODY_TIMEOUT_S = 0.6
SLOW_S = 1.5
"""How long the first request takes: well past the body timeout."""
LIMITS = ConnectionLimits(keepalive_s=30.0, header_timeout_s=30.0,
                          body_timeout_s=BODY_TIMEOUT_S, max_connections=16)
SLOW = b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n"
HEAD = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\n"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_S)
        await send_whole(send, b"slow")
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    await send_whole(send, body)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with guarded_server(app, LIMITS) as port:
        yield port


def test_a_body_sent_once_the_request_ahead_is_answered_is_in_time(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(SLOW + HEAD)
        (head, body), = responses(sock, 1)
        assert body == b"slow"
        sock.sendall(b"hello")
        (head, body), = responses(sock, 1)
        assert head.startswith(b"HTTP/1.1 200") and body == b"hello"


def test_a_pipelined_body_that_never_comes_still_gets_408(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(SLOW + HEAD)
        assert responses(sock, 1)[0][1] == b"slow"
        answered = time.monotonic()
        (head, _), = responses(sock, 1)
        assert head.startswith(b"HTTP/1.1 408")
        assert time.monotonic() - answered >= BODY_TIMEOUT_S - 0.1
