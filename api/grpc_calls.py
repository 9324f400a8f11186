"""gRPC calls over :mod:`api.h2_connection`: one :class:`GrpcCall` per HTTP/2 stream.

A call reads its request headers (method, deadline, encoding, the ``authorization``
key), checks the key, frames and bounds the length-prefixed messages of its body,
runs the method's behaviour in a task, and answers with a response head, messages and
trailers (``grpc-status``, ``grpc-message``), or trailers only for an error. A stream
the client resets cancels its task, as grpc.aio cancels a handler whose call is
cancelled. Statuses come from the one error table in :mod:`batching.errors`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import grpc
from google.protobuf.message import Message

from api import h2_codec as h2
from api.auth import Guard
from api.auth_grpc import grpc_need
from api.h2_connection import H2Connection
from batching.errors import ConveyorError

log = logging.getLogger(__name__)

OK = 0
_CODES = {code: code.value[0] for code in grpc.StatusCode}
_HEAD = b"\x88" + h2.literal_indexed_name(31, b"application/grpc")  # :status 200, content-type
_OK_TRAILERS = h2.literal(b"grpc-status", b"0")
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_ENCODINGS = {"gzip": 31, "deflate": 15}  # zlib wbits of each grpc-encoding
ACCEPT_ENCODING = "identity,deflate,gzip"
_READ = (":path", ":method", "content-type", "grpc-timeout", "grpc-encoding", "authorization")
"""The request headers a call reads itself."""
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
"""grpc-message percent-encodes all but printable ASCII, and ``%`` itself."""


@dataclass(frozen=True, slots=True)
class Method:
    request: type[Message]
    behaviour: Callable[..., Any]
    client_streaming: bool
    server_streaming: bool


class Abort(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Context:
    """What a servicer's behaviour may ask of its call: the part of grpc.aio's context
    conveyor's servicers use (``abort``). It holds nothing, so all calls share one."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Abort(_CODES[code], details)


CONTEXT = Context()
QUIET_SINCE: ContextVar[float | None] = ContextVar("conveyor_grpc_quiet_since", default=None)
"""In a call's task, when its connection last had no stream open (None: its first stream):
the call's request came after it, which bounds how long it waited unread (api/overload.py);
the behaviour's signature is grpc.aio's, so it travels beside it."""
RECEIVED_AT: ContextVar[float | None] = ContextVar("conveyor_grpc_received_at", default=None)
"""In a unary call's task, the ``time.perf_counter()`` at which its headers were read: the
request's clock starts there, not when its task first runs (api/http_guard.py
``RECEIVED_AT``). None in a streaming call's, whose messages come one by one."""


def status_block(code: int, message: str, head: bool) -> bytes:
    """The trailers of a call that ends with ``code`` (with the head: trailers only)."""
    block = (_HEAD if head else b"") + h2.literal(b"grpc-status", str(code).encode())
    if message:
        block += h2.literal(b"grpc-message", quote(message, safe=_MESSAGE_SAFE).encode())
    return block


def message_frame(message: Message, limit: int) -> bytes:
    raw: bytes = message.SerializeToString()
    if len(raw) > limit:
        raise Abort(_CODES[grpc.StatusCode.RESOURCE_EXHAUSTED],
                    f"Sent message larger than max ({len(raw)} vs. {limit})")
    return b"\x00" + len(raw).to_bytes(4, "big") + raw


def parse_timeout(value: str) -> float:
    unit = _TIMEOUT_UNITS.get(value[-1:])
    if unit is None or not value[:-1].isdigit() or len(value) > 9:
        raise Abort(_CODES[grpc.StatusCode.INVALID_ARGUMENT], f"bad grpc-timeout {value!r}")
    return int(value[:-1]) * unit


class CallEnv:
    """What every call of one listener shares."""

    def __init__(self, methods: dict[str, Method], guard: Guard, max_message: int) -> None:
        self.methods = methods
        self.guard = guard
        self.max_message = max_message
        self.calls: set[asyncio.Task[None]] = set()


class GrpcCall:
    __slots__ = (
        "_conn",
        "_deadline",
        "_done",
        "_env",
        "_head_sent",
        "_held",
        "_id",
        "_method",
        "_opened",
        "_queue",
        "_refusal",
        "_task",
        "_timer",
        "_wbits",
    )

    def __init__(self, env: CallEnv, conn: H2Connection, stream_id: int,
                 headers: list[tuple[str, str]]) -> None:
        self._opened = time.perf_counter()
        self._env, self._conn, self._id = env, conn, stream_id
        self._held = h2.Pending(5)
        self._queue: asyncio.Queue[Message | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._done = self._head_sent = False
        self._deadline: float | None = None
        self._wbits = 0
        self._refusal: Abort | None = None
        self._timer: asyncio.TimerHandle | None = None
        read = dict.fromkeys(_READ, "")
        for name, value in headers:
            if name in read:
                read[name] = value
        path, method_verb, content_type = read[":path"], read[":method"], read["content-type"]
        timeout, encoding, credentials = (read["grpc-timeout"], read["grpc-encoding"],
                                          read["authorization"])
        self._method: Method | None = None
        try:
            if method_verb != "POST" or not content_type.startswith("application/grpc"):
                raise Abort(_CODES[grpc.StatusCode.UNIMPLEMENTED],
                            "not a gRPC request (POST, content-type application/grpc)")
            if timeout:
                self._deadline = asyncio.get_running_loop().time() + parse_timeout(timeout)
            if encoding and encoding != "identity":
                if encoding not in _ENCODINGS:
                    raise Abort(_CODES[grpc.StatusCode.UNIMPLEMENTED],
                                f"grpc-encoding {encoding!r} is not supported ({ACCEPT_ENCODING})")
                self._wbits = _ENCODINGS[encoding]
            try:
                env.guard.check(grpc_need(path), credentials or None)
            except ConveyorError as exc:
                raise Abort(_CODES[grpc.StatusCode[exc.grpc_status]], exc.message) from None
            self._method = env.methods.get(path)
            if self._method is None:
                raise Abort(_CODES[grpc.StatusCode.UNIMPLEMENTED], f"Method not found: {path}")
        except Abort as exc:
            self._refusal = exc  # answered when the client has written (see data)
            return
        finally:
            if self._deadline is not None:
                self._timer = asyncio.get_running_loop().call_at(self._deadline, self._expire)
        if self._method.client_streaming:
            self._queue = asyncio.Queue()
            self._start(self._run(None))

    # --- StreamSink ---------------------------------------------------------------------
    def data(self, chunk: bytes, end: bool) -> None:
        if self._refusal is not None:
            # A refused call is answered once the client wrote to it: answered at its
            # headers, a streaming client of grpc's loses the status to its own first
            # write (INTERNAL). A unary call's headers and message come together.
            self._finish(self._refusal.code, self._refusal.message)
            self._refusal = None
        if self._done:
            self._conn.credit(self._id, len(chunk))
            return
        buf = b""
        try:
            whole = self._held.add(chunk)
            buf = whole if whole is not None else b""
            need = 5
            while len(buf) >= 5:
                size = int.from_bytes(buf[1:5], "big")
                if size > self._env.max_message:
                    raise Abort(_CODES[grpc.StatusCode.RESOURCE_EXHAUSTED],
                                f"Received message larger than max ({size} vs. "
                                f"{self._env.max_message})")
                if len(buf) < 5 + size:
                    need = 5 + size
                    break
                raw, compressed = buf[5:5 + size], buf[0]
                buf = buf[5 + size:]
                self._conn.credit(self._id, 5 + size)
                self._message(self._decoded(raw, compressed))
            if whole is not None:
                self._held.keep(buf, need)
                buf = b""
            if end:
                if self._held.size:
                    raise Abort(_CODES[grpc.StatusCode.INTERNAL], "the request ends inside a message")
                if self._queue is not None:
                    self._queue.put_nowait(None)
                elif self._task is None:
                    raise Abort(_CODES[grpc.StatusCode.UNIMPLEMENTED],
                                "a unary call without its request message")
        except Abort as exc:
            self._conn.credit(self._id, len(buf) + self._held.size)
            self._held.keep(b"", 5)
            if self._task is not None:
                self._task.cancel()
            self._finish(exc.code, exc.message)

    def reset(self) -> None:
        self._ended()
        if self._task is not None:
            self._task.cancel()

    # --- the call -----------------------------------------------------------------------
    def _decoded(self, raw: bytes, compressed: int) -> bytes:
        if not compressed:
            return raw
        if not self._wbits:
            raise Abort(_CODES[grpc.StatusCode.INTERNAL],
                        "a compressed message without grpc-encoding")
        inflate = zlib.decompressobj(self._wbits)
        try:
            out = inflate.decompress(raw, self._env.max_message + 1)
        except zlib.error as exc:
            raise Abort(_CODES[grpc.StatusCode.INTERNAL], f"undecompressable message: {exc}") from None
        if len(out) > self._env.max_message:
            raise Abort(_CODES[grpc.StatusCode.RESOURCE_EXHAUSTED],
                        f"Received message larger than max (more than {self._env.max_message} "
                        "bytes decompressed)")
        if not inflate.eof or inflate.unused_data:
            raise Abort(_CODES[grpc.StatusCode.INTERNAL],
                        "a compressed message that is truncated or has bytes after its end")
        return out

    def _message(self, raw: bytes) -> None:
        assert self._method is not None
        try:
            request = self._method.request.FromString(raw)
        except Exception as exc:  # DecodeError, or any other failure to read client bytes
            reason = f"{type(exc).__name__}: {exc}"[:200]
            raise Abort(_CODES[grpc.StatusCode.INVALID_ARGUMENT],
                        f"the request is not a valid protobuf message of this method: {reason}"
                        ) from None
        if self._queue is not None:
            self._queue.put_nowait(request)
        elif self._task is not None:
            raise Abort(_CODES[grpc.StatusCode.UNIMPLEMENTED],
                        "a unary call with more than one request message")
        else:
            self._start(self._run(request))

    def _start(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._task = task
        calls = self._env.calls
        calls.add(task)
        task.add_done_callback(calls.discard)

    async def _requests(self) -> AsyncIterator[Message]:
        assert self._queue is not None
        while (request := await self._queue.get()) is not None:
            yield request

    async def _run(self, request: Message | None) -> None:
        method = self._method
        assert method is not None
        context = CONTEXT
        QUIET_SINCE.set(self._conn.quiet_since)  # this task's own context
        RECEIVED_AT.set(None if request is None else self._opened)
        argument = self._requests() if request is None else request
        try:
            async with asyncio.timeout_at(self._deadline):
                limit = self._env.max_message
                if method.server_streaming:
                    async for answer in method.behaviour(argument, context):
                        self._send(message_frame(answer, limit))
                    self._finish(OK, "")
                else:
                    frame = message_frame(await method.behaviour(argument, context), limit)
                    if not self._done:
                        self._ended()
                        self._conn.send_headers(self._id, _HEAD)
                        self._conn.send_data(self._id, frame)
                        self._conn.send_headers(self._id, _OK_TRAILERS, end=True)
        except Abort as exc:
            self._finish(exc.code, exc.message)
        except TimeoutError:
            self._finish(_CODES[grpc.StatusCode.DEADLINE_EXCEEDED], "Deadline Exceeded")
        except asyncio.CancelledError:
            if not self._done:  # cancelled by the listener's shutdown, not by the client
                self._finish(_CODES[grpc.StatusCode.UNAVAILABLE], "the server is shutting down")
            raise
        except Exception as exc:
            log.exception("gRPC method %s failed", method.behaviour)
            self._finish(_CODES[grpc.StatusCode.UNKNOWN], f"Unexpected {type(exc)}: {exc}")

    def _send(self, frame: bytes) -> None:
        if self._done:
            return
        if not self._head_sent:
            self._head_sent = True
            self._conn.send_headers(self._id, _HEAD)
        self._conn.send_data(self._id, frame)

    def _expire(self) -> None:
        """The deadline passed before the call's task started (no request message yet)."""
        if self._task is None:
            self._finish(_CODES[grpc.StatusCode.DEADLINE_EXCEEDED], "Deadline Exceeded")

    def _ended(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()

    def _finish(self, code: int, message: str) -> None:
        if self._done:
            return
        self._ended()
        self._conn.send_headers(self._id, status_block(code, message, not self._head_sent),
                                end=True)
