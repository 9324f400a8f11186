"""The HTTP listener tells each request when its connection was last quiet (every request it
had sent answered): how long the request can have waited unread, which the API's overload
refusal uses (api/overload.py, api/http_guard.py ``QUIET_SINCE``)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from api.http_guard import QUIET_SINCE, ConnectionLimits, guarded_protocol
from tests.procs import free_port

LIMITS = ConnectionLimits(keepalive_s=30.0, header_timeout_s=30.0, body_timeout_s=30.0,
                          max_connections=16)
REQUEST = b"GET /quiet HTTP/1.1\r\nHost: t\r\n\r\n"
IDLE_S = 1.0
"""How long a connection sits idle in these tests: far longer than a busy host takes to
send a request right after an answer."""


async def quiet_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers how long ago the request's connection was last quiet, in seconds."""
    quiet = scope.get(QUIET_SINCE)
    body = b"none" if quiet is None else repr(time.perf_counter() - quiet).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(quiet_app, host="127.0.0.1", port=port, lifespan="off",
                            http=guarded_protocol(LIMITS), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def answers(sock: socket.socket, count: int) -> list[str]:
    """The bodies of the next ``count`` responses on ``sock``."""
    data, bodies = b"", list[str]()
    while len(bodies) < count:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            if len(rest) >= length:
                bodies.append(rest[:length].decode())
                data = rest[length:]
                continue
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return bodies


def ask(sock: socket.socket) -> str:
    sock.sendall(REQUEST)
    return answers(sock, 1)[0]


def test_a_request_sent_as_soon_as_answered_was_quiet_only_a_moment(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        # The first request may have waited unread with its connection, before the accept.
        assert ask(sock) == "none"
        assert float(ask(sock)) < IDLE_S / 2  # sent as soon as answered: quiet only since
        time.sleep(IDLE_S)
        assert float(ask(sock)) >= IDLE_S  # an idle keep-alive connection: quiet all along


def test_pipelined_requests_count_from_when_the_connection_was_last_quiet(port: int) -> None:
    """The second of two requests sent together was read with the first: it counts from
    when the connection was quiet before both, not from the first one's answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        assert ask(sock) == "none"
        time.sleep(IDLE_S)
        sock.sendall(REQUEST + REQUEST)
        waited = [float(body) for body in answers(sock, 2)]
    assert waited[0] >= IDLE_S and waited[1] >= IDLE_S, waited
