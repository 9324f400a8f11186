"""A request's whole body and whole response, straight from and to its connection.

uvicorn hands a request to the application as ASGI messages: ``receive()`` copies the
body out of the cycle, and ``send()`` takes the response in two messages, checks every
header against two regular expressions and writes the head and the body separately
(docs/data-path.md section 7 has what it cost and what this saves). The guarded HTTP
protocol (:mod:`api.http_guard`) leaves each request's uvicorn cycle in its scope under
:data:`CYCLE`, and the route uses it:

- :func:`collect_body`: the cycle gathers its body as :class:`BodyPieces`, which keeps
  each large piece the parser hands it as it is, where uvicorn's ``bytearray`` copied
  each piece in and ``bytes()`` copied the whole out again.
- :func:`ready_body`: the body, when all of it has arrived before the route asks and
  nothing else has read it (the usual request); a body that came in one large piece is
  that piece, not a copy. Otherwise the route reads it with ``receive()``, flow control
  and ``100 Continue`` included.
- :func:`write_response`: a whole response with a ``Content-Length``, its status line,
  headers and body in one ``transport.write``, and the cycle completed as uvicorn's own
  ``send`` completes it (keep-alive or close, the next pipelined request started).
  It declines (returns False) while the connection's writes are paused for a slow
  reader, so that the ASGI ``send``, which waits for the buffer to drain, answers.

Without a cycle in the scope (an application served some other way, as in the tests'
in-process client) the route keeps to plain ASGI.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

CYCLE = "conveyor.cycle"
"""Scope key of the request's :class:`RequestResponseCycle`."""

KEEP_BYTES = 8 * 1024
"""A piece of a body at least this large is kept as the parser made it; smaller ones are
gathered into one ``bytearray``, so that a body trickling in a byte at a time holds no
more than a body should."""

_defaults: tuple[list[tuple[bytes, bytes]] | None, bytes] = (None, b"")
"""The server's default headers (``date``, ``server``) last written, and their bytes.
uvicorn replaces the list once a second with the new date."""


def cycle_of(scope: MutableMapping[str, Any]) -> RequestResponseCycle | None:
    cycle = scope.get(CYCLE)
    return cycle if isinstance(cycle, RequestResponseCycle) else None


class BodyPieces:
    """What a cycle's ``body`` does for uvicorn (``+=`` a piece, ``len``, ``bytes``, all of
    it), without copying the large pieces in: ``bytes()`` of one large piece is that piece."""

    __slots__ = ("_pieces", "_size")

    def __init__(self) -> None:
        self._pieces: list[bytes | bytearray] = []
        self._size = 0

    def __iadd__(self, piece: bytes) -> BodyPieces:
        self._size += len(piece)
        pieces = self._pieces
        if len(piece) >= KEEP_BYTES:
            pieces.append(piece)
        elif pieces and isinstance(pieces[-1], bytearray):
            pieces[-1] += piece
        else:
            pieces.append(bytearray(piece))
        return self

    def __len__(self) -> int:
        return self._size

    def __bytes__(self) -> bytes:
        pieces = self._pieces
        if len(pieces) == 1:
            return bytes(pieces[0])  # a bytes piece itself; a bytearray copied
        return b"".join(pieces)


def collect_body(cycle: RequestResponseCycle) -> None:
    """Have ``cycle`` gather its body as :class:`BodyPieces` (before any of it arrives)."""
    cycle.body = BodyPieces()  # type: ignore[assignment]


def ready_body(cycle: RequestResponseCycle) -> bytes | None:
    """The request's whole body, taken from the cycle, when it has all arrived and nothing
    has read any of it; None when the route must read it with ``receive()``."""
    if cycle.more_body or cycle.waiting_for_100_continue or cycle.disconnected:
        return None
    body = bytes(cycle.body)
    cycle.body = bytearray()
    return body


def write_response(cycle: RequestResponseCycle, status: int,
                   headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
    """Write ``status``, ``headers`` (without ``Content-Length``, which is added) and
    ``body`` as the cycle's whole response in one write; False, with nothing written,
    when the ASGI ``send`` must answer instead (writes paused, or a response begun)."""
    if cycle.disconnected:  # the client left: like uvicorn's send, write nothing
        return True
    if cycle.response_started or cycle.flow.write_paused:
        return False
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    parts = [STATUS_LINE[status], _default_headers(cycle.default_headers)]
    closing = False
    for name, value in headers:
        if name == b"connection":
            closing = b"close" in value.lower()
            cycle.keep_alive = cycle.keep_alive and not closing
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"content-length: %d\r\n" % len(body))
    if not cycle.keep_alive and not closing:
        parts.append(b"connection: close\r\n")
    parts += (b"\r\n", body)
    cycle.transport.write(b"".join(parts))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
    return True


def _default_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    global _defaults
    written, data = _defaults
    if written is not headers:
        data = b"".join(b"%s: %s\r\n" % pair for pair in headers)
        _defaults = (headers, data)
    return data
