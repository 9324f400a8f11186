"""The HTTP listener tells each request when its connection was last quiet (every request it
had sent answered): how long the request can have waited unread, which the API's overload
refusal uses (api/overload.py, api/http_guard.py ``QUIET_SINCE``)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from api.http_guard import QUIET_SINCE, ConnectionLimits
from tests.guarded_server import guarded_server, responses, send_whole

LIMITS = ConnectionLimits(keepalive_s=30.0, header_timeout_s=30.0, body_timeout_s=30.0,
                          max_connections=16)
REQUEST = b"GET /quiet HTTP/1.1\r\nHost: t\r\n\r\n"
IDLE_S = 1.0
"""How long a connection sits idle in these tests: far longer than a busy host takes to
send a request right after an answer."""
SETTLE_S = 0.05
"""The listener marks a connection quiet just after it wrote the answer, which the client
can read first: a busy host may hold the listener that long in between."""


async def quiet_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers how long ago the request's connection was last quiet, in seconds."""
    quiet = scope.get(QUIET_SINCE)
    body = b"none" if quiet is None else repr(time.perf_counter() - quiet).encode()
    await send_whole(send, body)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with guarded_server(quiet_app, LIMITS) as port:
        yield port


def answers(sock: socket.socket, count: int) -> list[str]:
    """The bodies of the next ``count`` responses on ``sock``."""
    return [body.decode() for _, body in responses(sock, count)]


def ask(sock: socket.socket) -> str:
    sock.sendall(REQUEST)
    return answers(sock, 1)[0]


def test_a_request_sent_as_soon_as_answered_was_quiet_only_a_moment(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        # The first request may have waited unread with its connection, before the accept.
        assert ask(sock) == "none"
        assert float(ask(sock)) < IDLE_S / 2  # sent as soon as answered: quiet only since
        time.sleep(IDLE_S)
        assert float(ask(sock)) >= IDLE_S - SETTLE_S  # an idle keep-alive connection: quiet all along


def test_pipelined_requests_count_from_when_the_connection_was_last_quiet(port: int) -> None:
    """The second of two requests sent together was read with the first: it counts from
    when the connection was quiet before both, not from the first one's answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        assert ask(sock) == "none"
        time.sleep(IDLE_S)
        sock.sendall(REQUEST + REQUEST)
        waited = [float(body) for body in answers(sock, 2)]
    assert waited[0] >= IDLE_S - SETTLE_S and waited[1] >= IDLE_S - SETTLE_S, waited
