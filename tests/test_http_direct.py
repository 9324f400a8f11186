"""A request's whole body and whole response straight from and to its connection
(api/http_direct.py), on a real uvicorn server with the guarded protocol: what the infer
route does for every request, and where it must leave the work to plain ASGI."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from api.http_direct import KEEP_BYTES, BodyPieces, cycle_of, ready_body, write_response
from api.http_guard import ConnectionLimits
from tests.guarded_server import guarded_server, responses, send_whole

LIMITS = ConnectionLimits(keepalive_s=30.0, header_timeout_s=30.0, body_timeout_s=30.0,
                          max_connections=16)
GAP_S = 0.3
"""Between a request's head and its body, in the tests that split them."""


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers ``ready:<body>`` when the body was all there for the taking, else
    ``received:<body>``, written in one piece when it can be."""
    if scope["type"] != "http":
        return
    cycle = cycle_of(scope)
    assert cycle is not None
    assert isinstance(cycle.body, BodyPieces)  # gathered without copying large pieces in
    body = ready_body(cycle)
    how = b"ready:"
    if body is None:
        how, body = b"received:", b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
    content = how + body
    if not write_response(cycle, 200, [(b"content-type", b"text/plain")], content):
        await send_whole(send, content)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with guarded_server(echo_app, LIMITS) as port:
        yield port


def post(body: bytes, *extra: bytes) -> bytes:
    return b"".join([b"POST /echo HTTP/1.1\r\nHost: t\r\n", *extra,
                     b"Content-Length: %d\r\n\r\n" % len(body), body])


def test_a_body_that_has_arrived_is_taken_and_answered_with_the_usual_headers(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for n in range(3):  # kept alive: each request answered whole, the next one served
            sock.sendall(post(b"x" * (n + 1)))
            (head, body), = responses(sock, 1)
            assert body == b"ready:" + b"x" * (n + 1)
            lines = head.lower().split(b"\r\n")
            assert lines[0] == b"http/1.1 200 ok"
            assert b"content-type: text/plain" in lines
            assert any(line.startswith(b"date: ") for line in lines)
            assert b"connection: close" not in lines


def test_a_chunked_body_of_large_and_small_pieces_is_taken_whole(port: int) -> None:
    pieces = [b"x" * KEEP_BYTES, b"y", b"zz", b"w" * (KEEP_BYTES + 1), b"v"]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunked)
        (_, body), = responses(sock, 1)
        assert body.split(b":", 1)[1] == b"".join(pieces)


def test_a_body_that_comes_later_is_received(port: int) -> None:
    request = post(b"late")
    head, body = request[:-4], request[-4:]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        time.sleep(GAP_S)
        sock.sendall(body)
        assert responses(sock, 1)[0][1] == b"received:late"


def test_a_client_that_expects_100_continue_gets_it_before_its_body_is_read(port: int) -> None:
    request = post(b"asked", b"Expect: 100-continue\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request[:-5])
        assert sock.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n")
        sock.sendall(b"asked")
        assert responses(sock, 1)[0][1] == b"received:asked"


def test_pipelined_requests_are_answered_in_order(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(post(b"one") + post(b"two") + post(b"three"))
        assert [body for _, body in responses(sock, 3)] == [b"ready:one", b"ready:two",
                                                             b"ready:three"]


def test_a_request_asking_to_close_is_answered_and_its_connection_closed(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(post(b"bye", b"Connection: close\r\n"))
        (head, body), = responses(sock, 1)
        assert body == b"ready:bye"
        assert b"connection: close" in head.lower().split(b"\r\n")
        assert sock.recv(4096) == b""  # closed after the response


class Recorder:
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def cycle(keep_alive: bool = True) -> tuple[Any, Recorder, list[str]]:
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    transport, done = Recorder(), list[str]()
    scope: Any = {"type": "http", "method": "POST", "path": "/echo", "headers": []}
    made = RequestResponseCycle(
        scope=scope, transport=transport, flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=None, access_logger=None, access_log=False,  # type: ignore[arg-type]
        default_headers=[(b"server", b"t")], message_event=asyncio.Event(),
        expect_100_continue=False, keep_alive=keep_alive,
        on_response=lambda: done.append("answered"))
    return made, transport, done


def test_a_response_leaves_in_one_write_and_completes_its_request() -> None:
    made, transport, done = cycle()
    assert write_response(made, 404, [(b"content-type", b"application/json")], b"{}")
    assert transport.writes == [b"HTTP/1.1 404 Not Found\r\nserver: t\r\n"
                                b"content-type: application/json\r\ncontent-length: 2\r\n"
                                b"\r\n{}"]
    assert made.response_complete and done == ["answered"] and not transport.closed
    assert not write_response(made, 200, [], b"again")  # one response per request


def test_a_response_on_a_connection_that_is_not_kept_alive_says_so_and_closes() -> None:
    made, transport, _ = cycle(keep_alive=False)
    assert write_response(made, 200, [], b"ok")
    assert b"\r\nconnection: close\r\n" in transport.writes[0] and transport.closed


def test_a_slow_reader_leaves_the_response_to_asgi_which_waits_for_the_buffer() -> None:
    made, transport, done = cycle()
    made.flow.pause_writing()
    assert not write_response(made, 200, [], b"ok")
    assert transport.writes == [] and done == [] and not made.response_started


def test_a_client_that_left_is_written_nothing() -> None:
    made, transport, done = cycle()
    made.disconnected = True
    assert write_response(made, 200, [], b"ok")
    assert transport.writes == [] and done == []
