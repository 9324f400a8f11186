"""Request bodies read and inflated within bounds, and the gate on large ones.

Every body is counted as it streams in and refused (:class:`PayloadTooLarge`, 413) as
soon as it passes the limit, or before a byte is read when ``Content-Length`` already
says so. A gzip or deflate body is inflated in steps of at most ``INFLATE_STEP`` bytes
out (and ``INFLATE_INPUT`` in), yielding to the event loop between steps, so neither a
decompression bomb's memory nor its CPU time lands on the other clients.

A body that is large (``large_body_bytes``, by ``Content-Length`` or once that much has
arrived or been inflated) holds one of ``max_large_bodies`` places of its process while
it is read, inflated and parsed; small ones never wait for a place.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from types import TracebackType
from typing import Any

from batching.errors import InvalidInput, PayloadTooLarge
from batching.settings import Settings

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

INFLATE_STEP = 256 * 1024
"""Most bytes one decompression step writes (a few hundred microseconds of work)."""
INFLATE_INPUT = 64 * 1024
"""Most compressed bytes one decompression step reads (bounds steps that write nothing)."""
_GZIP_WBITS = 16 + zlib.MAX_WBITS
MAX_REQUEST_SETTING = "CONVEYOR_MAX_REQUEST_BYTES"


class BodyLimits:
    """One API process's body limits and its places for large bodies (infer and jobs)."""

    def __init__(self, max_bytes: int, large_bytes: int, max_large: int) -> None:
        self.max_bytes = max_bytes
        self.large_bytes = large_bytes
        self.places = asyncio.Semaphore(max_large)

    @classmethod
    def from_settings(cls, settings: Settings) -> BodyLimits:
        return cls(settings.max_request_bytes, settings.large_body_bytes,
                   settings.max_large_bodies)

    def claim(self) -> LargeBody:
        return LargeBody(self)


class LargeBody:
    """One request's place among the large bodies, taken once its body turns out large."""

    __slots__ = ("_limits", "held")

    def __init__(self, limits: BodyLimits) -> None:
        self._limits = limits
        self.held = False

    async def grow(self, size: int) -> None:
        """The body (read or inflated) has reached ``size`` bytes: take a place if large."""
        if not self.held and size >= self._limits.large_bytes:
            await self._limits.places.acquire()
            self.held = True

    async def __aenter__(self) -> LargeBody:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.held:
            self.held = False
            self._limits.places.release()


def content_length(value: bytes | str | None) -> int | None:
    """A ``Content-Length``-style header: ASCII digits only, else None (not given or unusable)."""
    if value is None or not value.isdigit() or not value.isascii():
        return None
    return int(value)


async def read_body(receive: Receive, claim: LargeBody, declared: int | None, limit: int,
                    setting: str = MAX_REQUEST_SETTING, ready: bytes | None = None) -> bytes:
    """The whole body of an ASGI request, refused as soon as it passes ``limit`` bytes.

    ``declared``: the request's ``Content-Length``, checked before anything is read.
    ``setting``: the variable that sets ``limit``, for the error message.
    ``ready``: the whole body, when the listener already had all of it
    (:func:`api.http_direct.ready_body`): checked the same way, and nothing is received.
    """
    if declared is not None:
        if declared > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes is above the limit of "
                                  f"{limit} bytes ({setting})")
        await claim.grow(declared)
    body = _Bounded(claim, limit, f"request body is above the limit of {limit} bytes ({setting})")
    if ready is not None:
        await body.add(ready)
        return body.joined()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidInput("the client closed the connection before the end of the body")
        await body.add(message.get("body", b""))
        if not message.get("more_body", False):
            return body.joined()


class _Bounded:
    """Bytes gathered in pieces, refused with ``PayloadTooLarge(refusal)`` once they pass
    ``limit``; the large-body claim grows with them."""

    def __init__(self, claim: LargeBody, limit: int, refusal: str) -> None:
        self._claim = claim
        self._limit = limit
        self._refusal = refusal
        self._pieces: list[bytes] = []
        self._size = 0

    async def add(self, piece: bytes) -> None:
        if piece:
            self._size += len(piece)
            if self._size > self._limit:
                raise PayloadTooLarge(self._refusal)
            self._pieces.append(piece)
            await self._claim.grow(self._size)

    def joined(self) -> bytes:
        return self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)


async def drain(receive: Receive) -> None:
    """Read the rest of a body that will not be used, so the connection can serve the next."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return


async def inflate(body: bytes, encoding: str, claim: LargeBody, limit: int) -> bytes:
    """Undo a request's ``Content-Encoding`` (gzip, or deflate in zlib or raw form).

    The output is refused as soon as it passes ``limit`` bytes; between steps the event
    loop runs other work. Bad compressed data is a 400.
    """
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return body
    if name == "gzip":
        wbits = _GZIP_WBITS
    elif name == "deflate":
        wbits = zlib.MAX_WBITS if _zlib_header(body) else -zlib.MAX_WBITS
    else:
        raise InvalidInput(f"unsupported Content-Encoding {encoding!r}; use gzip or deflate")
    try:
        return await _inflate(memoryview(body), wbits, claim, limit)
    except zlib.error as exc:
        raise InvalidInput(f"request body is not valid {name}: {exc}") from None


def _zlib_header(body: bytes) -> bool:
    """Whether ``body`` starts as a zlib stream (RFC 1950) rather than raw deflate."""
    return len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] << 8 | body[1]) % 31 == 0


async def _inflate(view: memoryview, wbits: int, claim: LargeBody, limit: int) -> bytes:
    stream = zlib.decompressobj(wbits)
    out = _Bounded(claim, limit, f"request body inflates to more than the limit of {limit} "
                                 f"bytes ({MAX_REQUEST_SETTING})")
    pos = 0
    while True:
        data: bytes | memoryview = stream.unconsumed_tail
        if not data:
            data = view[pos:pos + INFLATE_INPUT]
            pos += len(data)
        piece = stream.decompress(data, INFLATE_STEP)
        await out.add(piece)
        if stream.eof:
            pos -= len(stream.unused_data)
            if pos == len(view):
                return out.joined()
            if wbits != _GZIP_WBITS:
                raise InvalidInput(f"request body has {len(view) - pos} bytes after the end of "
                                   "its deflate stream")
            stream = zlib.decompressobj(wbits)  # gzip allows several members, one after another
        elif not piece and not data:
            raise InvalidInput("request body ends before its compressed stream does")
        await asyncio.sleep(0)
