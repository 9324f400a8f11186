"""A request's clock starts when the listener read it, not when its task first ran: its
timeout (the deadline its worker sees, the API's own wait) and its duration count from
there (api/http_guard.py and api/grpc_calls.py ``RECEIVED_AT``, api/service.py). Under load
the two are apart by the event loop's turn; for a pipelined request, by the requests
before it on its connection."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import MutableMapping
from typing import Any

import orjson
from google.protobuf.wrappers_pb2 import BytesValue
from grpc import StatusCode as Code

from api import h2_codec as h2
from api.body import BodyLimits
from api.http_guard import RECEIVED_AT, ConnectionLimits
from api.infer import InferRoute
from api.metrics import ApiMetrics
from api.service import InferenceService
from batching.envelope import Reply, Request, Tensor
from batching.keys import Keys
from tests.guarded_server import guarded_server, responses
from tests.h2_harness import RECEIVED, Raw, grpc_message, run, serve
from tests.test_body import CONFIG, AllServed, fallback, request_body

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
    """Its message came ``HELD_S`` after its headers: its task ran only then."""
    async with serve() as server:
        raw = await Raw.connect(server)
        raw.send(raw.head(1, RECEIVED))
        await asyncio.sleep(HELD_S)
        message = grpc_message(BytesValue(value=b"").SerializeToString())
        raw.send(h2.frame(h2.DATA, h2.END_STREAM, 1, message))
        body, status = await raw.answer(1)
    assert status == Code.OK
    assert float(BytesValue.FromString(body[5:]).value) >= HELD_S


class RecordingDispatcher:
    """Answers every request at once; keeps each request and the wait it was given."""

    reply_key = "replies"

    def __init__(self) -> None:
        self.submitted: list[tuple[Request, float]] = []

    def new_id(self) -> str:
        return f"r{len(self.submitted)}"

    async def submit(self, admission: Any, request: Request, timeout_s: float) -> Reply:
        self.submitted.append((request, timeout_s))
        x = request.inputs[0]
        return Reply(request.id, [Tensor("y", x.datatype, x.shape, x.raw)])


async def infer_read_ago(seconds: float, timeout_ms: int
                         ) -> tuple[int, bytes, RecordingDispatcher]:
    """A request with ``parameters.timeout`` of ``timeout_ms`` whose bytes were read
    ``seconds`` before its task ran: its status and body, and what the dispatcher was
    given."""
    dispatcher = RecordingDispatcher()
    service = InferenceService({"m": CONFIG}, dispatcher, AllServed(), Keys("t"),  # type: ignore[arg-type]
                               ApiMetrics(), BodyLimits(1 << 20, 1 << 16, 2))
    body = request_body(parameters={"timeout": timeout_ms * 1000})
    scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer",
             "headers": [(b"content-length", str(len(body)).encode())],
             RECEIVED_AT: time.perf_counter() - seconds}
    status, answer = 0, b""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal status, answer
        if message["type"] == "http.response.start":
            status = message["status"]
        else:
            answer += message.get("body", b"")

    await InferRoute(fallback, service)(scope, receive, send)
    return status, answer, dispatcher


def test_the_deadline_a_worker_sees_counts_from_when_the_request_was_read() -> None:
    before_ms = time.time() * 1000.0
    status, _, dispatcher = asyncio.run(infer_read_ago(0.3, 1000))
    after_ms = time.time() * 1000.0
    assert status == 200
    [(request, wait_s)] = dispatcher.submitted
    # its bytes were read 300 ms before a moment between before_ms and after_ms, so its
    # deadline is 700 ms after that moment, however long the host took to get there
    assert before_ms + 700 - 1 <= request.deadline_ms <= after_ms + 700
    # and its wait is what was left of those 700 ms when it was queued
    assert (request.deadline_ms - after_ms - 1) / 1000.0 <= wait_s <= 0.7 + 0.001


def test_a_request_whose_timeout_passed_before_it_was_queued_is_504_and_never_queued() -> None:
    status, answer, dispatcher = asyncio.run(infer_read_ago(0.3, 100))
    assert status == 504
    assert "deadline passed before it could be queued (its timeout: 100 ms)" in \
        orjson.loads(answer)["error"]
    assert dispatcher.submitted == []
