"""A test server for the native gRPC listener's HTTP/2 connection (api.h2_connection)
and gRPC calls (api.grpc_calls), in process: a method table of this file's own on
127.0.0.1, a grpc.aio client for it and a raw-frame client (tests/test_h2_native.py).

Nothing here imports ``api.proto`` (see tests/test_auth.py): every message is a
``google.protobuf.wrappers_pb2.BytesValue``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ParamSpec

import grpc
import hpack
from google.protobuf.wrappers_pb2 import BytesValue
from grpc import StatusCode as Code

from api import h2_codec as h2
from api.auth import Guard, KeyStore
from api.grpc_calls import QUIET_SINCE, RECEIVED_AT, CallEnv, Context, GrpcCall, Method
from api.h2_connection import H2Connection, Limits, StreamSink

P = ParamSpec("P")
WAIT_S = 10.0
"""How long anything awaited may take (a busy 2-core machine); the tests take far less."""
ECHO, HOLD, CHAT = "/test.Svc/Echo", "/test.Svc/Hold", "/test.Svc/Chat"
QUIET = "/test.Svc/Quiet"
"""Answers how long ago its connection last had no stream open (b"none": never)."""
RECEIVED = "/test.Svc/Received"
"""Answers how long ago its call's clock started (b"none": no clock)."""
INFER = "/inference.GRPCInferenceService/ModelInfer"  # needs the infer scope (api.auth_grpc)
CODES = {code.value[0]: code for code in Code}


def limits(window: int = 8 << 20, max_streams: int = 100) -> Limits:
    return Limits(window, max_streams, idle_s=300.0, keepalive_s=60.0, keepalive_timeout_s=20.0)


class Server:
    """What grpc_native's ``_App`` is (a GrpcCall per stream) and the methods it serves;
    it keeps its connections and every stream's request headers."""

    def __init__(self, guard: Guard, max_message: int, conn_limits: Limits) -> None:
        unary = {ECHO: self.echo, "/test.Svc/Expand": self.expand, HOLD: self.hold,
                 "/test.Svc/Boom": self.boom, INFER: self.echo, QUIET: self.quiet,
                 RECEIVED: self.received}
        methods = {path: Method(BytesValue, fn, False, False) for path, fn in unary.items()}
        methods[CHAT] = Method(BytesValue, self.chat, True, True)
        self.env = CallEnv(methods, guard, max_message)
        self.limits = conn_limits
        self.conns: list[H2Connection] = []
        self.headers: list[list[tuple[str, str]]] = []
        self.clients: list[asyncio.StreamWriter] = []  # the raw clients' connections
        self.port = 0
        self.started, self.cancelled, self.release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def open_stream(self, conn: H2Connection, stream_id: int,
                    headers: list[tuple[str, str]]) -> StreamSink:
        self.headers.append(headers)
        return GrpcCall(self.env, conn, stream_id, headers)

    def protocol(self) -> H2Connection:
        conn = H2Connection(self, self.limits)
        self.conns.append(conn)
        return conn

    async def echo(self, request: BytesValue, context: Context) -> BytesValue:
        return request

    async def quiet(self, request: BytesValue, context: Context) -> BytesValue:
        since = QUIET_SINCE.get()
        return BytesValue(value=b"none" if since is None else
                          repr(time.perf_counter() - since).encode())

    async def received(self, request: BytesValue, context: Context) -> BytesValue:
        at = RECEIVED_AT.get()
        return BytesValue(value=b"none" if at is None else
                          repr(time.perf_counter() - at).encode())

    async def expand(self, request: BytesValue, context: Context) -> BytesValue:
        return BytesValue(value=request.value * 10)

    async def hold(self, request: BytesValue, context: Context) -> BytesValue:
        """Answers once ``release`` is set; ``cancelled`` tells its task was cancelled."""
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return request

    async def boom(self, request: BytesValue, context: Context) -> BytesValue:
        raise RuntimeError("boom")

    async def chat(self, requests: AsyncIterator[BytesValue],
                   context: Context) -> AsyncIterator[BytesValue]:
        async for request in requests:
            yield BytesValue(value=request.value.upper())


@contextlib.asynccontextmanager
async def serve(guard: Guard | None = None, max_message: int = 4 << 20,
                conn_limits: Limits | None = None) -> AsyncIterator[Server]:
    server = Server(guard or Guard(KeyStore(None), auth_health=False, auth_metrics=False),
                    max_message, conn_limits or limits())
    listener = await asyncio.get_running_loop().create_server(server.protocol, "127.0.0.1", 0)
    server.port = int(listener.sockets[0].getsockname()[1])
    try:
        yield server
    finally:
        listener.close()
        for writer in server.clients:
            writer.close()
        for conn in server.conns:
            conn.close()
        calls = set(server.env.calls)
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await listener.wait_closed()


def run(test: Callable[P, Awaitable[None]]) -> Callable[P, None]:
    """An async test, in an event loop of its own, bounded in time."""
    @functools.wraps(test)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 3 * WAIT_S))
    return wrapper


async def waited(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), WAIT_S)


# --- a grpc.aio client ----------------------------------------------------------------
def channel(server: Server, **kwargs: Any) -> Any:
    return grpc.aio.insecure_channel(f"127.0.0.1:{server.port}",
                                     options=[("grpc.enable_http_proxy", 0)], **kwargs)


async def ask(chan: Any, path: str, value: bytes = b"", **kwargs: Any) -> tuple[Code, bytes]:
    """A unary call's status and answer."""
    try:
        answer = await chan.unary_unary(path, request_serializer=BytesValue.SerializeToString,
                                        response_deserializer=BytesValue.FromString
                                        )(BytesValue(value=value), **kwargs)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), b""
    return Code.OK, bytes(answer.value)


def bidi(chan: Any, path: str, *args: Any, **kwargs: Any) -> Any:
    return chan.stream_stream(path, request_serializer=BytesValue.SerializeToString,
                              response_deserializer=BytesValue.FromString)(*args, **kwargs)


async def streamed(chan: Any, path: str, values: list[bytes]) -> Code:
    """The status of a stream_stream call that sends ``values`` and reads every answer."""
    try:
        async for _ in bidi(chan, path, iter([BytesValue(value=v) for v in values])):
            pass
    except grpc.aio.AioRpcError as exc:
        code: Code = exc.code()
        return code
    return Code.OK


# --- a raw HTTP/2 client --------------------------------------------------------------
def grpc_message(payload: bytes, compressed: bool = False) -> bytes:
    return bytes((compressed,)) + len(payload).to_bytes(4, "big") + payload


def value(message: bytes) -> bytes:
    return bytes(BytesValue.FromString(message[5:]).value)


class Raw:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()

    @classmethod
    async def connect(cls, server: Server, settings: dict[int, int] | None = None,
                      preface: bytes = h2.PREFACE) -> Raw:
        raw = cls(*await asyncio.open_connection("127.0.0.1", server.port))
        server.clients.append(raw.writer)
        raw.send(preface + (h2.settings_frame(settings or {}) if preface == h2.PREFACE else b""))
        return raw

    def send(self, *frames: bytes) -> None:
        self.writer.write(b"".join(frames))

    def head(self, stream_id: int, path: str, **headers: str) -> bytes:
        """A gRPC request's HEADERS frame (``grpc_timeout=`` is grpc-timeout)."""
        block = self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                     (":authority", "t"), ("content-type", "application/grpc"),
                                     ("te", "trailers"),
                                     *((k.replace("_", "-"), v) for k, v in headers.items())])
        return h2.frame(h2.HEADERS, h2.END_HEADERS, stream_id, block)

    def request(self, stream_id: int, path: str, body: bytes | None = b"",
                compressed: bool = False, **headers: str) -> None:
        """HEADERS, then (unless ``body`` is None) one message and END_STREAM."""
        self.send(self.head(stream_id, path, **headers))
        if body is not None:
            self.send(h2.frame(h2.DATA, h2.END_STREAM, stream_id, grpc_message(body, compressed)))

    async def frame(self) -> tuple[int, int, int, bytes]:
        """The next frame: (type, flags, stream id, payload)."""
        word, flags, stream_id = struct.unpack(
            ">IBI", await asyncio.wait_for(self.reader.readexactly(9), WAIT_S))
        payload = await asyncio.wait_for(self.reader.readexactly(word >> 8), WAIT_S)
        return word & 0xFF, flags, stream_id, payload

    async def until(self, kind: int, stream_id: int = 0) -> tuple[int, bytes]:
        """(flags, payload) of the next frame of this type on this stream."""
        while True:
            got, flags, sid, payload = await self.frame()
            if got == kind and sid == stream_id:
                return flags, payload

    async def answer(self, stream_id: int) -> tuple[bytes, Code]:
        """A stream's response body (DATA) and grpc-status (from its last header block)."""
        body, headers = b"", {}
        while True:
            kind, flags, sid, payload = await self.frame()
            if sid != stream_id:
                continue
            assert kind != h2.RST_STREAM, f"stream {stream_id} reset"
            if kind == h2.DATA:
                body += payload
            elif kind == h2.HEADERS:
                headers = {str(k): str(v) for k, v in self.decoder.decode(payload)}
            if flags & h2.END_STREAM:
                return body, CODES[int(headers["grpc-status"])]

    async def refused(self, stream_id: int) -> bool:
        return int.from_bytes((await self.until(h2.RST_STREAM, stream_id))[1], "big") \
            == h2.REFUSED_STREAM

    async def goaway(self) -> tuple[int, int]:
        """(last stream id, error code) of the server's GOAWAY."""
        _, payload = await self.until(h2.GOAWAY)
        return int.from_bytes(payload[:4], "big"), int.from_bytes(payload[4:8], "big")

    async def eof(self) -> None:
        """Until the server closes the connection (TimeoutError after WAIT_S)."""
        with contextlib.suppress(ConnectionError):
            while await asyncio.wait_for(self.reader.read(65_536), WAIT_S):
                pass


# --- gRPC calls through grpc.aio ------------------------------------------------------
