"""Request bodies in-process: size limits, bounded inflation, the gate on large bodies, and
the unknown model answered before its body is read. The infer route runs as a bare ASGI
app in front of an echoing dispatcher (no Redis)."""

from __future__ import annotations

import asyncio
import gzip
import tracemalloc
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pytest
from starlette.requests import Request as StarletteRequest
from starlette.types import Message

from api import body as body_module
from api.body import BodyLimits, inflate
from api.infer import InferRoute
from api.metrics import ApiMetrics
from api.service import InferenceService
from batching.config import ModelConfig
from batching.envelope import Reply, Request, Tensor
from batching.errors import InvalidInput, PayloadTooLarge
from batching.keys import Keys

CONFIG = ModelConfig.from_dict("m", {
    "backend": "python", "max_batch_size": 1 << 20,
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]})
KIB = 1024
MIB = 1024 * KIB


class EchoDispatcher:
    """Answers every request at once with its input renamed ``y``; keeps each request and
    the wait it was given."""

    reply_key = "replies"

    def __init__(self) -> None:
        self.submitted: list[Request] = []
        self.waits: list[float] = []

    def new_id(self) -> str:
        return f"r{len(self.submitted)}"

    async def submit(self, admission: Any, request: Request, timeout_s: float) -> Reply:
        self.submitted.append(request)
        self.waits.append(timeout_s)
        x = request.inputs[0]
        return Reply(request.id, [Tensor("y", x.datatype, x.shape, x.raw)])


class AllServed:
    def model_served(self, model: str) -> bool:
        return True


async def fallback(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the infer route fell through")


def make_route(max_bytes: int = MIB, large: int = 64 * KIB,
               max_large: int = 2) -> tuple[InferRoute, EchoDispatcher]:
    dispatcher = EchoDispatcher()
    service = InferenceService({"m": CONFIG}, dispatcher, AllServed(), Keys("t"),  # type: ignore[arg-type]
                               ApiMetrics(), BodyLimits(max_bytes, large, max_large))
    return InferRoute(fallback, service), dispatcher


@dataclass
class Call:
    """One raw ASGI request: what was sent back, and how much of the body was read."""

    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytes = b""
    chunks_read: int = 0

    def json(self) -> Any:
        return orjson.loads(self.body)


async def call(route: InferRoute, chunks: list[bytes], headers: dict[str, str] | None = None,
               model: str = "m", declare: bool = True,
               wait: Callable[[int], Awaitable[None]] | None = None,
               scope_extra: dict[str, Any] | None = None) -> Call:
    """POST ``chunks`` as one body; ``declare``: send Content-Length; ``wait(i)`` is
    awaited before chunk ``i`` is handed over; ``scope_extra``: more keys of the scope."""
    result = Call()
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if declare:
        raw_headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
    scope = {"type": "http", "method": "POST", "path": f"/v2/models/{model}/infer",
             "headers": raw_headers, **(scope_extra or {})}

    async def receive() -> dict[str, Any]:
        i = result.chunks_read
        if i >= len(chunks):
            raise AssertionError("body read past its end")
        if wait is not None:
            await wait(i)
        result.chunks_read += 1
        return {"type": "http.request", "body": chunks[i], "more_body": i + 1 < len(chunks)}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            result.status = message["status"]
            result.headers = dict(message["headers"])
        else:
            result.body += message.get("body", b"")

    await route(scope, receive, send)
    return result


def request_body(rows: int = 1, **extra: Any) -> bytes:
    data = np.arange(rows * 4, dtype=np.float32).tolist()
    return orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 4],
                                     "data": data}], **extra})


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)] or [b""]


def test_a_small_request_is_answered() -> None:
    route, _ = make_route()
    answer = asyncio.run(call(route, [request_body(id="a")]))
    assert answer.status == 200, answer.body
    assert answer.json()["id"] == "a"
    assert answer.json()["outputs"][0]["data"] == [0.0, 1.0, 2.0, 3.0]


def test_a_declared_oversize_body_is_413_before_a_byte_is_read() -> None:
    route, dispatcher = make_route(max_bytes=MIB)
    answer = asyncio.run(call(route, split(b"x" * (MIB + 1), 64 * KIB)))
    assert answer.status == 413
    assert "CONVEYOR_MAX_REQUEST_BYTES" in answer.json()["error"]
    assert answer.chunks_read == 0
    assert answer.headers[b"connection"] == b"close"
    assert not dispatcher.submitted


def test_an_undeclared_oversize_body_stops_being_read_at_the_limit() -> None:
    route, _ = make_route(max_bytes=MIB)
    chunks = split(b"x" * (8 * MIB), 64 * KIB)
    answer = asyncio.run(call(route, chunks, declare=False))
    assert answer.status == 413
    assert answer.chunks_read == MIB // (64 * KIB) + 1  # the chunk that went over, no more
    assert answer.headers[b"connection"] == b"close"


def test_a_body_at_the_limit_is_served() -> None:
    body = request_body(rows=3)
    route, _ = make_route(max_bytes=len(body))
    assert asyncio.run(call(route, split(body, 7), declare=False)).status == 200


def test_unknown_model_is_404_without_reading_a_large_body() -> None:
    route, _ = make_route(large=64 * KIB)
    answer = asyncio.run(call(route, split(b"x" * (4 * MIB), 64 * KIB), model="nope"))
    assert answer.status == 404
    assert answer.chunks_read == 0
    assert answer.headers[b"connection"] == b"close"


def test_unknown_model_with_a_small_body_drains_it_and_keeps_the_connection() -> None:
    route, _ = make_route(large=64 * KIB)
    chunks = split(request_body(rows=8), 100)
    answer = asyncio.run(call(route, chunks, model="nope"))
    assert answer.status == 404
    assert answer.chunks_read == len(chunks)
    assert b"connection" not in answer.headers


def gzip_bomb(size: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b"\0" * MIB
    return b"".join([*(packer.compress(block) for _ in range(size // MIB)), packer.flush()])


def test_a_gzip_bomb_is_413_with_bounded_memory() -> None:
    bomb = gzip_bomb(64 * MIB)
    assert len(bomb) < MIB
    route, _ = make_route(max_bytes=4 * MIB)
    tracemalloc.start()
    try:
        answer = asyncio.run(call(route, [bomb], headers={"Content-Encoding": "gzip"}))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert answer.status == 413
    assert "inflates to more than the limit of 4194304 bytes" in answer.json()["error"]
    assert peak < 4 * MIB + len(bomb) + 2 * MIB


def test_inflating_yields_to_the_event_loop_between_steps() -> None:
    data = b"\0" * (16 * MIB)
    packed = gzip.compress(data)

    async def run() -> tuple[bytes, int]:
        ticks = 0
        done = False

        async def ticker() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        async with BodyLimits(32 * MIB, 64 * KIB, 1).claim() as claim:
            out = await inflate(packed, "gzip", claim, 32 * MIB)
        done = True
        await task
        return out, ticks - before

    out, ticks = asyncio.run(run())
    assert out == data
    assert ticks >= 16 * MIB // body_module.INFLATE_STEP - 1


@pytest.mark.parametrize("encoding,packed", [
    ("gzip", gzip.compress(b"abc" * 1000, mtime=0)),
    ("GZIP ", gzip.compress(b"abc" * 500, mtime=0) * 2),  # two members
    ("deflate", zlib.compress(b"abc" * 1000)),
    ("deflate", zlib.compress(b"abc" * 1000, wbits=-zlib.MAX_WBITS)),  # raw deflate
    ("identity", b"abc" * 1000),
])
def test_inflate_takes_gzip_and_both_deflate_forms(encoding: str, packed: bytes) -> None:
    async def run() -> bytes:
        async with BodyLimits(MIB, 64 * KIB, 1).claim() as claim:
            return await inflate(packed, encoding, claim, MIB)

    assert asyncio.run(run()) == b"abc" * 1000


@pytest.mark.parametrize("encoding,packed,message", [
    ("gzip", b"not gzip at all", "not valid gzip"),
    ("gzip", gzip.compress(b"abc" * 1000, mtime=0)[:-12], "ends before its compressed stream does"),
    ("gzip", gzip.compress(b"abc", mtime=0) + b"\0\0", "not valid gzip"),
    ("deflate", zlib.compress(b"abc") + b"junk", "4 bytes after the end of its deflate stream"),
    ("br", b"abc", "unsupported Content-Encoding 'br'"),
])
def test_bad_compressed_bodies_are_400(encoding: str, packed: bytes, message: str) -> None:
    async def run() -> bytes:
        async with BodyLimits(MIB, 64 * KIB, 1).claim() as claim:
            return await inflate(packed, encoding, claim, MIB)

    with pytest.raises(InvalidInput, match=message):
        asyncio.run(run())
    route, _ = make_route()
    answer = asyncio.run(call(route, [packed], headers={"Content-Encoding": encoding}))
    assert answer.status == 400 and message in answer.json()["error"]


def test_a_gzip_request_is_answered() -> None:
    route, _ = make_route()
    answer = asyncio.run(call(route, [gzip.compress(request_body(rows=2))],
                              headers={"Content-Encoding": "gzip"}))
    assert answer.status == 200
    assert answer.json()["outputs"][0]["shape"] == [2, 4]


def test_large_bodies_wait_for_a_place_and_small_ones_never_do() -> None:
    """One place: a second large body waits while the first holds it; a small one passes."""
    large = request_body(rows=4096)  # about 80 KiB of JSON
    assert len(large) > 64 * KIB

    async def run() -> list[str]:
        route, _ = make_route(large=64 * KIB, max_large=1)
        release_first = asyncio.Event()
        finished: list[str] = []

        async def first_waits(i: int) -> None:
            if i == 1:
                await release_first.wait()

        async def one(name: str, body: bytes,
                      wait: Callable[[int], Awaitable[None]] | None = None) -> None:
            answer = await call(route, split(body, 32 * KIB), wait=wait)
            assert answer.status == 200, answer.body
            finished.append(name)

        first = asyncio.create_task(one("first", large, first_waits))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(one("second", large))
        await one("small", request_body())
        await asyncio.sleep(0.05)
        assert finished == ["small"]  # the second large body waits for the place
        release_first.set()
        await asyncio.gather(first, second)
        return finished

    assert asyncio.run(run()) == ["small", "first", "second"]


def test_an_undeclared_body_takes_a_place_once_it_grows_large() -> None:
    async def run() -> tuple[list[bool], bool]:
        limits = BodyLimits(MIB, 64 * KIB, 1)
        seen: list[bool] = []
        async with limits.claim() as claim:
            sent = 0

            async def receive() -> dict[str, Any]:
                nonlocal sent
                seen.append(claim.held)
                sent += 1
                return {"type": "http.request", "body": b"x" * (32 * KIB), "more_body": sent < 4}

            await body_module.read_body(receive, claim, None, MIB)
            seen.append(claim.held)
        return seen, limits.places.locked()

    # 32 KiB read: small; 64 KiB: large from then on; the place is given back at the end.
    assert asyncio.run(run()) == ([False, False, True, True, True], False)


def test_job_bodies_share_the_places_and_keep_their_own_limit() -> None:
    from api.job_routes import _read_body

    async def run(size: int, limit: int) -> tuple[bytes, bool]:
        limits = BodyLimits(MIB, 64 * KIB, 1)
        sent = iter([b"x" * size])

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": next(sent), "more_body": False}

        request = StarletteRequest({"type": "http", "method": "POST", "path": "/v1/jobs",
                                    "headers": []}, receive)
        async with limits.claim() as claim:
            return await _read_body(request, claim, limit), limits.places.locked()

    body, locked = asyncio.run(run(100 * KIB, MIB))
    assert len(body) == 100 * KIB and locked
    with pytest.raises(PayloadTooLarge, match="CONVEYOR_JOB_MAX_BYTES"):
        asyncio.run(run(100 * KIB, 64 * KIB))
