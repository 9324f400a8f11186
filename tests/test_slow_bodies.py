"""Bodies that come too slowly: on HTTP/1.1 (``python -m api.serve``) each way a body can be
framed or reached is answered 408 within ``CONVEYOR_HTTP_BODY_TIMEOUT_S`` of its headers
and its connection closed; on the native gRPC listener's HTTP/2 a message trickled in has
its stream reset. Each is counted in ``conveyor_body_timeouts_total``."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from google.protobuf.wrappers_pb2 import BytesValue

from api import body_timeouts
from api import h2_codec as h2
from api.h2_connection import Limits
from tests.h2_harness import CHAT, ECHO, Raw, grpc_message, run, serve, value
from tests.h2_harness import INFER as INFER_METHOD
from tests.listener_harness import LIVE, connect, read_response, start_serve, wait_live
from tests.procs import RedisServer, free_port

BODY_TIMEOUT_S = 2.0
MARGIN_S = 3.0
"""Slack for a busy host: the body is cut within its timeout plus this."""

INFER = b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
SIZED = b"Content-Length: 1000\r\n\r\n"


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def slow_api(redis_server: RedisServer, logdir: Path, grpc_port: int) -> Iterator[int]:
    """Header and keep-alive deadlines far off: only the body deadline can cut."""
    proc, port = start_serve(redis_server, logdir, "slow",
                             CONVEYOR_HTTP_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S),
                             CONVEYOR_HTTP_HEADER_TIMEOUT_S="60", CONVEYOR_HTTP_KEEPALIVE_S="60",
                             CONVEYOR_GRPC_PORT=str(grpc_port))
    wait_live(proc, f"http://127.0.0.1:{port}")
    yield port
    proc.stop()


def cut_off(port: int, listener: str = "http") -> float:
    """``conveyor_body_timeouts_total{listener=...}`` of the API on ``port``."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    found = re.search(rf'^conveyor_body_timeouts_total\{{listener="{listener}"\}} (\S+)$', text,
                      re.M)
    assert found is not None, text
    return float(found.group(1))


def trickle(sock: socket.socket, byte: bytes, limit_s: float) -> tuple[float, bytes]:
    """Send ``byte`` every 0.2 s until the server closes: seconds until then, all it sent."""
    started, got = time.monotonic(), b""
    while time.monotonic() - started < limit_s:
        try:
            sock.sendall(byte)
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started, got
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                return time.monotonic() - started, got
            if not data:
                return time.monotonic() - started, got
            got += data
    raise AssertionError(f"connection still open after {limit_s} s: {got!r}")


CASES = {
    "sized": (INFER + SIZED + b"{", b" "),
    "chunked": (INFER + b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n", b"1\r\n \r\n"),
    "pipelined in one packet": (LIVE + INFER + SIZED + b"{", b" "),
    "unknown model": (b"POST /v2/models/nope/infer HTTP/1.1\r\nHost: t\r\n" + SIZED + b"{", b" "),
    "other route": (b"POST /v2/repository/index HTTP/1.1\r\nHost: t\r\n" + SIZED + b"{", b" "),
    "large first chunk": (INFER + b"Content-Length: 2000000\r\n\r\n{" + b" " * 200_000, b" "),
    "100-continue": (INFER + b"Expect: 100-continue\r\n" + SIZED, b" "),
}


@pytest.mark.parametrize("case", CASES)
def test_a_trickled_body_is_answered_408_and_counted(slow_api: int, case: str) -> None:
    first, byte = CASES[case]
    before = cut_off(slow_api)
    with connect(slow_api) as sock:
        sock.sendall(first)
        took, got = trickle(sock, byte, BODY_TIMEOUT_S + MARGIN_S)
    assert took >= BODY_TIMEOUT_S - 0.6
    answer = got[got.index(b"HTTP/1.1 408"):]  # after a 200 or 100 Continue before it
    assert b'{"error":"request body not received within 2 s"}' in answer, got
    assert b"connection: close" in answer.lower()
    assert cut_off(slow_api) == before + 1


def test_a_body_trickled_on_a_kept_alive_connection_is_cut(slow_api: int) -> None:
    with connect(slow_api) as sock:
        sock.sendall(LIVE)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(INFER + SIZED + b"{")
        took, got = trickle(sock, b" ", BODY_TIMEOUT_S + MARGIN_S)
    assert took >= BODY_TIMEOUT_S - 0.6 and got.startswith(b"HTTP/1.1 408"), got


def test_a_body_trickled_after_an_early_answer_is_cut(slow_api: int) -> None:
    """Answered (404) before its body came: the connection is closed at the body deadline."""
    with connect(slow_api) as sock:
        sock.sendall(b"POST /nope HTTP/1.1\r\nHost: t\r\n" + SIZED + b"{")
        took, got = trickle(sock, b" ", BODY_TIMEOUT_S + MARGIN_S)
    assert took >= BODY_TIMEOUT_S - 0.6 and got.startswith(b"HTTP/1.1 404"), got


# --- HTTP/2 (the native gRPC listener) -----------------------------------------------------

H2_TIMEOUT_S = 0.5


def h2_limits() -> Limits:
    return Limits(8 << 20, 100, idle_s=300.0, keepalive_s=60.0, keepalive_timeout_s=20.0,
                  body_timeout_s=H2_TIMEOUT_S)


def grpc_cut_off() -> float:
    return float(body_timeouts.counter().labels("grpc")._value.get())


@run
async def test_a_trickled_grpc_message_has_its_stream_reset_and_counted() -> None:
    before = grpc_cut_off()
    async with serve(conn_limits=h2_limits()) as server:
        raw = await Raw.connect(server)
        message = grpc_message(BytesValue(value=b"x" * 50).SerializeToString())
        raw.send(raw.head(1, ECHO))
        started = asyncio.get_running_loop().time()
        reset = asyncio.ensure_future(raw.until(h2.RST_STREAM, 1))
        for byte in message[:-1]:
            if reset.done():
                break
            raw.send(h2.frame(h2.DATA, 0, 1, bytes((byte,))))
            await asyncio.wait([reset], timeout=0.05)
        _, code = await reset
        took = asyncio.get_running_loop().time() - started
        assert int.from_bytes(code, "big") == h2.CANCEL
        assert H2_TIMEOUT_S - 0.1 <= took < H2_TIMEOUT_S + MARGIN_S
        assert not server.conns[0].streams
        raw.request(3, ECHO, BytesValue(value=b"after").SerializeToString())
        body, _ = await raw.answer(3)  # the connection still serves
        assert value(body) == b"after"
    assert grpc_cut_off() == before + 1


async def trickle_grpc(port: int, limit_s: float) -> tuple[float, int]:
    """A ModelInfer whose message comes a byte every 0.05 s: seconds until its stream is
    reset, and the RST_STREAM code."""
    raw = Raw(*await asyncio.open_connection("127.0.0.1", port))
    raw.send(h2.PREFACE + h2.settings_frame({}), raw.head(1, INFER_METHOD))
    loop = asyncio.get_running_loop()
    started = loop.time()
    reset = asyncio.ensure_future(raw.until(h2.RST_STREAM, 1))
    try:
        for byte in grpc_message(b"\x0a\x04echo" * 20):
            if reset.done() or loop.time() - started > limit_s:
                break
            raw.send(h2.frame(h2.DATA, 0, 1, bytes((byte,))))
            await asyncio.wait([reset], timeout=0.05)
        _, code = await asyncio.wait_for(reset, limit_s)
        return loop.time() - started, int.from_bytes(code, "big")
    finally:
        raw.writer.close()


def test_the_api_s_grpc_listener_takes_the_body_timeout_setting(slow_api: int,
                                                                grpc_port: int) -> None:
    before = cut_off(slow_api, "grpc")
    took, code = asyncio.run(trickle_grpc(grpc_port, BODY_TIMEOUT_S + MARGIN_S))
    assert code == h2.CANCEL and BODY_TIMEOUT_S - 0.6 <= took < BODY_TIMEOUT_S + MARGIN_S
    assert cut_off(slow_api, "grpc") == before + 1


@run
async def test_a_grpc_stream_may_wait_between_whole_messages() -> None:
    before = grpc_cut_off()
    async with serve(conn_limits=h2_limits()) as server:
        raw = await Raw.connect(server)
        raw.send(raw.head(1, CHAT))
        for word in (b"one", b"two"):
            raw.send(h2.frame(h2.DATA, 0, 1, grpc_message(BytesValue(value=word).SerializeToString())))
            assert value((await raw.until(h2.DATA, 1))[1]) == word.upper()
            await asyncio.sleep(2 * H2_TIMEOUT_S)  # idle past the timeout, nothing begun
        assert 1 in server.conns[0].streams
    assert grpc_cut_off() == before
