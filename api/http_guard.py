"""Connection-level guards for the HTTP listener: uvicorn's httptools protocol with limits.

One instance per connection. It closes a connection that has not sent complete request
headers within ``header_timeout_s`` of connecting or of its previous response (slowloris),
answers 408 (or closes, once a response has started) when a request body does not
complete within ``body_timeout_s`` of its headers (counted in
``conveyor_body_timeouts_total``; a pipelined request's from when it starts, as its
connection is not read until then), answers 431 to request headers larger than
``max_header_bytes``, closes idle keep-alive connections after ``keepalive_s`` and closes
a new connection at once while ``max_connections`` are open. Used by :mod:`api.serve`.
The header and keep-alive deadlines share one timer per connection (uvicorn sets and
cancels two per request); a body timer is set only for a body still to come once the
bytes that held its headers are parsed.

Each request's scope says when its first bytes were read (:data:`RECEIVED_AT`), where its
clock starts. Each request's uvicorn cycle is in its scope (:data:`api.http_direct.CYCLE`), for the
infer route to take a body that has all arrived and to write its answer in one piece.

A client that hangs up before its response is complete is told to the application: the
function a request's scope holds under :data:`DISCONNECT_HOOK` (set by the infer route,
:mod:`api.infer`) is called, which cancels the request and withdraws it from its queue.

Framing: a request with both ``Transfer-Encoding: chunked`` and ``Content-Length`` is
read as chunked, as RFC 9112 section 6.3 says (llhttp refuses it unless told to be
lenient), its ``Content-Length`` is dropped before the application sees the headers,
and the connection is closed after the response (the RFC asks that of a server taking
such a request). Errors the parser answers by itself have ``{"error": ...}`` bodies.

Past capacity, a request for a model whose adaptive policy has ``batching.overload:
lifo`` is refused as soon as its headers are parsed when it has waited unread too long
to be answered in time (api/overload.py ``refuses_unread``; how long it can have waited:
api/turns.py, from the read that began it; a connection's first request from before its
accept): a pre-encoded 503 with ``Retry-After``, written once its body has been read past
(never parsed), without an application task. Only on a connection with no other request
in hand, so that the answers keep their order.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.server import ServerState

from api import body_timeouts
from api.coalesce import CoalescingTransport
from api.http_direct import CYCLE, collect_body
from api.overload import active
from batching.errors import ConveyorError, HeadersTooLarge, InvalidInput, RequestTimeout
from batching.settings import Settings

log = logging.getLogger("conveyor.api")

MAX_HEADER_BYTES = 64 * 1024
"""Request line and headers of one request, at most (h11's default is 16 KiB)."""
WARN_EVERY_S = 60.0
"""A full connection table is logged at most this often."""
INFER_URL = re.compile(rb"^/v2/models/([^/?%]+)(?:/versions/[^/?%]+)?/infer$")
"""The model of an infer request's URL (a percent-encoded name is left to the route)."""
_UNREAD_BODY = (b'{"error":"past capacity: the request waited unread longer than its model\'s '
                b'latency target allows"}')
UNREAD_REFUSAL = b"".join([STATUS_LINE[503], b"content-type: application/json\r\n",
                           b"retry-after: 1\r\n",
                           b"content-length: %d\r\n\r\n" % len(_UNREAD_BODY), _UNREAD_BODY])
"""The answer to a request refused for its unread wait, written as it is."""
UNREAD_REFUSAL_CLOSE = UNREAD_REFUSAL.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1)
DISCONNECT_HOOK = "conveyor.on_disconnect"
"""Scope key of a function (no arguments) to call when the client hangs up before the
response to that request is complete."""
RECEIVED_AT = "conveyor.received_at"
"""Scope key of the ``time.perf_counter()`` at which the bytes that began the request were
read from its socket: the request's clock starts there (its timeout, its duration), not
when its task first runs. Under load the two are apart by the loop's turn (every request
read in the same turn is parsed before any of them runs) and, for a pipelined request, by
the requests before it on its connection."""
QUIET_SINCE = "conveyor.quiet_since"
"""Scope key of the ``time.perf_counter()`` at which every request the connection had sent
was answered, the last time it was so. The request's bytes arrived after it, so it bounds
how long they can have waited unread (api/overload.py). Absent on a connection's first
request: its bytes may have waited, with the connection itself, before it was accepted."""


@dataclass(frozen=True)
class ConnectionLimits:
    keepalive_s: float
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_header_bytes: int = MAX_HEADER_BYTES

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        return cls(keepalive_s=settings.http_keepalive_s,
                   header_timeout_s=settings.http_header_timeout_s,
                   body_timeout_s=settings.http_body_timeout_s,
                   max_connections=settings.http_max_connections)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpProtocol]:
    """The protocol class to pass as ``http=`` to :class:`uvicorn.Config`."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})


class GuardedHttpProtocol(HttpToolsProtocol):
    limits: ClassVar[ConnectionLimits]
    _last_warning: ClassVar[float] = float("-inf")

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.parser.set_dangerous_leniencies(lenient_chunked_length=True)
        self._chunked = False
        self._sized = False
        """The request has Transfer-Encoding, Content-Length (both: read as chunked)."""
        self._watchdog: asyncio.TimerHandle | None = None
        self._watch_at = 0.0
        """When the watchdog fires (``time.perf_counter()``)."""
        self._waiting_since: float | None = None
        """When the connection began to wait for a request's headers (connected, or every
        request it had sent answered); None while a request's headers are complete."""
        self._idle = False
        """Kept alive after an answer, and no byte of the next request yet."""
        self._body_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._headed = 0
        """Requests whose headers are complete."""
        self._answered = 0
        """Requests whose response is complete."""
        self._quiet_since: float | None = None
        """When the connection last had no request in hand (:data:`QUIET_SINCE`)."""
        self._read_at = 0.0
        """When the bytes being parsed were read (``time.perf_counter()``)."""
        self._read_after: float | None = None
        """Those bytes arrived after this ``time.perf_counter()``, when known (api/turns.py)."""
        self._began_after: float | None = None
        """The same, for the read that began the current request."""
        self._born_after: float | None = None
        """The same for the connection itself, until its first read."""
        self._first_read = True
        self._refusing = False
        """The current request is refused unread: its body is skipped, then answered."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        full = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if full:
            self._warn_full()
            transport.close()
            return
        self.transport = CoalescingTransport(transport, self.loop)  # type: ignore[assignment]
        overload = active(self.loop)
        if overload is not None and overload.turns is not None:
            self._born_after = overload.turns.read()
        self._wait_for_headers(time.perf_counter(), idle=False)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._disarm_body_timer()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            hook = cycle.scope.get(DISCONNECT_HOOK)
            if callable(hook):
                hook()

    # Parser callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._header_bytes = 0
        self._chunked = self._sized = False
        self._idle = False  # a byte of the next request: keep-alive no longer applies
        super().on_message_begin()  # the request's scope: its clock starts with these bytes
        self.scope[RECEIVED_AT] = self._read_at  # type: ignore[literal-required]
        self._began_after = self._read_after

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        if self._header_bytes > self.limits.max_header_bytes:
            raise self._headers_too_large()
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        """uvicorn's own, with the header bytes counted and the framing noted."""
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > self.limits.max_header_bytes:
            raise self._headers_too_large()
        name = name.lower()
        value = value.rstrip(b" \t")  # RFC 9110 section 5.5: no trailing whitespace
        if name == b"content-length":
            self._sized = True
        elif name == b"transfer-encoding":
            self._chunked = True
        elif name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._refuses_unread():
            self._refusing = True  # the header watchdog still bounds its body
            return
        self._waiting_since = None
        self._headed += 1
        framed_twice = self._chunked and self._sized
        if framed_twice:  # the body is chunked: its Content-Length means nothing
            self.headers[:] = [(n, v) for n, v in self.headers if n != b"content-length"]
        if self._quiet_since is not None:
            self.scope[QUIET_SINCE] = self._quiet_since  # type: ignore[literal-required]
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # a cycle of this request's
            self.scope[CYCLE] = cycle  # type: ignore[literal-required]
            collect_body(cycle)
            if framed_twice:
                cycle.keep_alive = False

    def on_body(self, body: bytes) -> None:
        if not self._refusing:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refusing:
            self._refuse_unread()
            return
        self._disarm_body_timer()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """The parser failed; when it was the header limit that stopped it, say so."""
        if self._header_bytes > self.limits.max_header_bytes:
            self._reject(self._headers_too_large())
        else:
            self._reject(InvalidInput(msg))

    # Request life ---------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._read_at = time.perf_counter()
        overload = active(self.loop)
        if overload is not None and overload.turns is not None:
            after = overload.turns.read()
            if self._first_read:  # its bytes may have come with the connection
                after = None if after is None or self._born_after is None else min(
                    after, self._born_after)
            self._read_after = after
        self._first_read = False
        super().data_received(data)
        cycle = self.cycle
        # The running request's body, still to come once these bytes are parsed, must come
        # in time. Checked here, not when the headers complete: the body is usually in the
        # same bytes. A pipelined request's is timed from when it starts.
        if (cycle is not None and cycle.more_body and self._body_timer is None
                and self._waiting_since is None and not cycle.response_complete
                and not self.pipeline):
            self._time_body(cycle)

    def _time_body(self, cycle: RequestResponseCycle) -> None:
        self._disarm_body_timer()
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s,
                                                self._body_late, cycle)

    def on_response_complete(self) -> None:
        """uvicorn's own, with its keep-alive timer left to the watchdog."""
        self.server_state.total_requests += 1
        self._answered += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            if cycle.more_body:
                self._time_body(cycle)
        if self._answered == self._headed:
            self._quiet_since = now = time.perf_counter()
            self._wait_for_headers(now, idle=True)

    # Refused unread -------------------------------------------------------------------
    def _refuses_unread(self) -> bool:
        """Whether the request whose headers are complete is refused for its unread wait
        (module docstring)."""
        since = self._began_after
        if since is None or self.expect_100_continue or self.parser.get_method() != b"POST":
            return False
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return False  # a request in hand: an answer now would overtake its
        overload = active(self.loop)
        found = INFER_URL.match(self.url)
        if overload is None or found is None:
            return False
        return overload.refuses_unread(found.group(1).decode("ascii"),
                                       time.perf_counter() - since, id(self))

    def _refuse_unread(self) -> None:
        """The refused request's body has been read past: answer it."""
        self._refusing = False
        self.server_state.total_requests += 1
        overload, found = active(self.loop), INFER_URL.match(self.url)
        if overload is not None and found is not None:  # counted with the API's 503s
            overload.refusal_answered(found.group(1).decode("ascii"), time.perf_counter()
                                      - self.scope[RECEIVED_AT])  # type: ignore[literal-required]
        if not self.parser.should_keep_alive():
            self.transport.write(UNREAD_REFUSAL_CLOSE)
            self.transport.close()
            return
        self.transport.write(UNREAD_REFUSAL)
        if self._answered == self._headed:
            self._quiet_since = now = time.perf_counter()
            self._wait_for_headers(now, idle=True)

    # Limits ---------------------------------------------------------------------------
    def _wait_for_headers(self, now: float, idle: bool) -> None:
        """From ``now`` the connection waits for the next request's headers: it is closed
        unless they are complete within ``header_timeout_s``, or, kept alive after an
        answer (``idle``), unless the request begins within ``keepalive_s``.

        One timer per connection, set again only when it would fire too late: a busy
        connection pays a few assignments per request, not a timer set and cancelled."""
        self._waiting_since = now
        self._idle = idle
        ends = now + self._wait_limit(idle)
        if self._watchdog is None or ends < self._watch_at:
            self._arm_watchdog(now, ends)

    def _arm_watchdog(self, now: float, at: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watch_at = at
        self._watchdog = self.loop.call_later(at - now, self._watch)

    def _wait_limit(self, idle: bool) -> float:
        limits = self.limits
        return min(limits.keepalive_s, limits.header_timeout_s) if idle else limits.header_timeout_s

    def _watch(self) -> None:
        """Close the connection if its wait has run out; else look again when it would."""
        self._watchdog = None
        since = self._waiting_since
        if since is None or self.transport.is_closing():
            return  # a request is in hand: the next answer starts a new wait
        now = time.perf_counter()
        ends = since + self._wait_limit(self._idle)
        if ends <= now:
            self.transport.close()
        else:
            self._arm_watchdog(now, ends)

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _headers_too_large(self) -> HeadersTooLarge:
        """Raised inside the parser, the error stops it; :meth:`send_400_response` answers."""
        return HeadersTooLarge(f"request line and headers larger than "
                               f"{self.limits.max_header_bytes} bytes")

    def _body_late(self, cycle: RequestResponseCycle) -> None:
        self._body_timer = None
        body_timeouts.count("http")
        if cycle.response_started:
            self.transport.close()
            return
        cycle.disconnected = True  # the application's further sends go nowhere
        cycle.message_event.set()
        self._reject(RequestTimeout(
            f"request body not received within {self.limits.body_timeout_s:g} s"))

    def _reject(self, error: ConveyorError) -> None:
        """Answer ``error`` and close the connection."""
        body = orjson.dumps({"error": error.message})
        self.transport.write(b"".join([
            STATUS_LINE[error.http_status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body]))
        self.transport.close()

    def _warn_full(self) -> None:
        now = time.monotonic()
        if now - GuardedHttpProtocol._last_warning >= WARN_EVERY_S:
            GuardedHttpProtocol._last_warning = now
            log.warning("%d HTTP connections open (CONVEYOR_HTTP_MAX_CONNECTIONS): "
                        "closing new ones", self.limits.max_connections)

