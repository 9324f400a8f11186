"""A request's clock starts when the listener read it, not when its task first ran: its
timeout (the deadline its worker sees, the API's own wait) and its duration count from
there (api/http_guard.py and api/grpc_calls.py ``RECEIVED_AT``, api/service.py). Under load
the two are apart by the event loop's turn; for a pipelined request, by the requests
before it on its connection."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

from google.protobuf.wrappers_pb2 import BytesValue
from grpc import StatusCode as Code

from api import h2_codec as h2
from api.http_guard import RECEIVED_AT, ConnectionLimits
from tests.guarded_server import guarded_server, responses
from tests.h2_harness import RECEIVED, Raw, grpc_message, run, serve
from tests.test_body import Call, EchoDispatcher, call, make_route, request_body

HELD_S = 0.3
"""How long the first of two pipelined requests is held before its answer."""
LIMITS = ConnectionLimits(keepalive_s=30.0, header_timeout_s=30.0, body_timeout_s=30.0,
                          max_connections=16)


async def clock_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``/hold`` answers after ``HELD_S``; every request answers how long ago its clock
    started, in seconds."""
    if scope["path"] == "/hold":
        await asyncio.sleep(HELD_S)
    at = scope.get(RECEIVED_AT)
    body = b"none" if at is None else repr(time.perf_counter() - at).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def test_a_pipelined_request_s_clock_starts_when_it_was_read() -> None:
    """Sent with the first request, the second is read with it, and waits for the first's
    answer before its own task runs: that wait is on its clock."""
    with guarded_server(clock_app, LIMITS) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /hold HTTP/1.1\r\nHost: t\r\n\r\nGET /next HTTP/1.1\r\nHost: t\r\n\r\n")
        first, second = (float(body) for _, body in responses(sock, 2))
    assert first >= HELD_S
    assert second >= HELD_S, second


@run
async def test_a_grpc_call_s_clock_starts_when_its_headers_were_read() -> None:
    """Its message came ``HELD_S`` after its headers were read (a PING sent behind them
    was answered, so the listener had read them): its task ran only then."""
    async with serve() as server:
        raw = await Raw.connect(server)
        raw.send(raw.head(1, RECEIVED), h2.frame(h2.PING, 0, 0, b"headers!"))
        while await raw.until(h2.PING) != (h2.ACK, b"headers!"):
            pass
        await asyncio.sleep(HELD_S)
        message = grpc_message(BytesValue(value=b"").SerializeToString())
        raw.send(h2.frame(h2.DATA, h2.END_STREAM, 1, message))
        body, status = await raw.answer(1)
    assert status == Code.OK
    assert float(BytesValue.FromString(body[5:]).value) >= HELD_S


async def infer_read_ago(seconds: float, timeout_ms: int) -> tuple[Call, EchoDispatcher]:
    """A request with ``parameters.timeout`` of ``timeout_ms`` whose bytes were read
    ``seconds`` before its task ran: what it was answered, and what the dispatcher was
    given."""
    route, dispatcher = make_route()
    body = request_body(parameters={"timeout": timeout_ms * 1000})
    answer = await call(route, [body], scope_extra={RECEIVED_AT: time.perf_counter() - seconds})
    return answer, dispatcher


def test_the_deadline_a_worker_sees_counts_from_when_the_request_was_read() -> None:
    before_ms = time.time() * 1000.0
    answer, dispatcher = asyncio.run(infer_read_ago(0.3, 1000))
    after_ms = time.time() * 1000.0
    assert answer.status == 200
    [request], [wait_s] = dispatcher.submitted, dispatcher.waits
    # its bytes were read 300 ms before a moment between before_ms and after_ms, so its
    # deadline is 700 ms after that moment, however long the host took to get there
    assert before_ms + 700 - 1 <= request.deadline_ms <= after_ms + 700
    # and its wait is what was left of those 700 ms when it was queued
    assert (request.deadline_ms - after_ms - 1) / 1000.0 <= wait_s <= 0.7 + 0.001


def test_a_request_whose_timeout_passed_before_it_was_queued_is_504_and_never_queued() -> None:
    answer, dispatcher = asyncio.run(infer_read_ago(0.3, 100))
    assert answer.status == 504
    assert "deadline passed before it could be queued (its timeout: 100 ms)" in \
        answer.json()["error"]
    assert dispatcher.submitted == []
