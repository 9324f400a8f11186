"""The HTTP listener's timeouts and limits (``python -m api.serve``): the header, keep-alive
and body deadlines, the connection limit and the header size limit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.http_guard import MAX_HEADER_BYTES
from tests.listener_harness import (
    LIVE,
    closed,
    connect,
    listening_hosts,
    read_response,
    start_serve,
    trickle_until_closed,
    wait_live,
)
from tests.procs import RedisServer, wait_for

# --- HTTP timeouts -------------------------------------------------------------------------

HEADER_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 2.0
KEEPALIVE_S = 0.3
MARGIN_S = 3.0
"""Slack for a busy host: a timeout fires within its setting plus this."""


@pytest.fixture(scope="module")
def timed_api(redis_server: RedisServer, logdir: Path) -> Iterator[int]:
    proc, port = start_serve(redis_server, logdir, "timed",
                             CONVEYOR_HTTP_HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S),
                             CONVEYOR_HTTP_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S),
                             CONVEYOR_HTTP_KEEPALIVE_S=str(KEEPALIVE_S))
    wait_live(proc, f"http://127.0.0.1:{port}")
    yield port
    proc.stop()


def test_http_listens_on_loopback_only_by_default(timed_api: int) -> None:
    assert listening_hosts(timed_api) == {"127.0.0.1"}


def test_trickled_headers_are_cut_off_at_the_header_timeout(timed_api: int) -> None:
    with connect(timed_api) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n")
        took = trickle_until_closed(sock, b"X-Slow: 1\r\n", 0.5, HEADER_TIMEOUT_S + MARGIN_S)
    assert took >= HEADER_TIMEOUT_S - 0.6


def test_the_header_timeout_restarts_after_each_response(timed_api: int) -> None:
    """Every byte resets the keep-alive timer; the header timer still runs from the answer."""
    with connect(timed_api) as sock:
        sock.sendall(LIVE)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        took = trickle_until_closed(sock, b"X-Slow: 1\r\n", 0.1, HEADER_TIMEOUT_S + MARGIN_S)
    assert took >= HEADER_TIMEOUT_S - 0.6


def test_idle_keepalive_connections_are_closed(timed_api: int) -> None:
    with connect(timed_api) as sock:
        sock.sendall(LIVE)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        sock.sendall(LIVE)  # a second request on the same connection is served
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        while not closed(sock):
            assert time.monotonic() - answered < HEADER_TIMEOUT_S - 0.5, "idle connection kept"


def test_a_slow_body_gets_408(timed_api: int) -> None:
    with connect(timed_api) as sock:
        sock.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        started = time.monotonic()
        answer = b""
        while not answer:
            assert time.monotonic() - started < BODY_TIMEOUT_S + MARGIN_S, "no 408"
            sock.sendall(b" ")
            time.sleep(0.2)
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                continue
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"error"' in answer and b"connection: close" in answer.lower()
    assert time.monotonic() - started >= BODY_TIMEOUT_S - 0.6


def test_a_complete_body_in_time_is_not_cut(timed_api: int) -> None:
    response = httpx.post(f"http://127.0.0.1:{timed_api}/v2/repository/index", json={})
    assert response.status_code != 408


# --- HTTP connection and header limits -----------------------------------------------------

MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def limited_api(redis_server: RedisServer, logdir: Path) -> Iterator[int]:
    proc, port = start_serve(redis_server, logdir, "limited",
                             CONVEYOR_HTTP_MAX_CONNECTIONS=str(MAX_CONNECTIONS))
    wait_live(proc, f"http://127.0.0.1:{port}")
    yield port
    proc.stop()


def test_connections_beyond_the_limit_are_closed_at_once(limited_api: int) -> None:
    time.sleep(0.5)  # earlier connections (the fixture's probes) are gone by now
    held = [connect(limited_api) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # each is open and served, so each holds a slot
            sock.sendall(LIVE)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
        extra = connect(limited_api)
        with extra:
            wait_for(lambda: closed(extra), 5, "the connection over the limit to be closed")
        held[0].sendall(LIVE)  # those within the limit are still served
        assert read_response(held[0]).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{limited_api}/v2/health/live",
                               timeout=2).status_code == 200, 10, "a free connection slot")


def test_oversized_request_headers_get_431(limited_api: int) -> None:
    padding = b"a" * (MAX_HEADER_BYTES + 1)
    with connect(limited_api) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nX-Big: " + padding + b"\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 431")
    response = httpx.get(f"http://127.0.0.1:{limited_api}/v2/health/live",
                         headers={"X-Fine": "a" * 1000})
    assert response.status_code == 200
