"""One HTTP/2 connection (RFC 9113, server side) as an asyncio protocol, for the native
gRPC listener (:mod:`api.grpc_native`).

It frames, keeps the peer's header table and both directions' flow-control windows
(:mod:`api.h2_flow`), answers PING and SETTINGS, and hands each stream to the
application: ``open_stream`` when its headers arrive, then the stream's
:class:`StreamSink` gets its data and, if the peer resets it or the connection drops,
``reset``. What the application writes in one event-loop tick leaves in one ``write``.

Bounds: a frame is at most ``MAX_FRAME_SIZE``; a header list ``MAX_HEADER_LIST_SIZE``;
``max_streams`` streams at once (more are refused with REFUSED_STREAM); what a peer
may send before the application consumed it is the receive window, which the
application credits back as it takes whole messages; a message begun and not whole
within ``body_timeout_s`` of its first byte (a body trickled in) has its stream reset
(``CANCEL``) and counted in ``conveyor_body_timeouts_total``. A stream with nothing begun
is not timed: a client stream may wait between messages.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from typing import Protocol, cast

from api import body_timeouts
from api import h2_codec as h2
from api.h2_flow import H2Stream, RecvFlow, SendFlow

log = logging.getLogger(__name__)

MAX_FRAME_SIZE = 1 << 20
"""The largest frame a peer may send us (our SETTINGS_MAX_FRAME_SIZE)."""
MAX_HEADER_LIST_SIZE = 16_384
BODY_TIMEOUT_S = 30.0
"""A message's bytes all come within this of its first (CONVEYOR_HTTP_BODY_TIMEOUT_S's default)."""
TICK_S = 10.0
"""How often a connection checks its idle, keepalive and ping deadlines."""

_FRAME = struct.Struct(">IBI")  # length << 8 | type, flags, stream id (R bit included)


class StreamSink(Protocol):
    def data(self, chunk: bytes, end: bool) -> None:
        """The next bytes of the stream's body; ``end`` after its last."""

    def reset(self) -> None:
        """The peer reset the stream or the connection was lost: nothing more is sent."""


class StreamApp(Protocol):
    def open_stream(self, conn: H2Connection, stream_id: int,
                    headers: list[tuple[str, str]]) -> StreamSink:
        """A new stream's request headers."""


class Limits:
    """What one connection allows its peer, and its timers (seconds)."""

    def __init__(self, window: int, max_streams: int, idle_s: float, keepalive_s: float,
                 keepalive_timeout_s: float, body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.window = min(h2.MAX_WINDOW, max(window, h2.DEFAULT_WINDOW))
        self.max_streams = max_streams
        self.idle_s = idle_s
        self.keepalive_s = keepalive_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.body_timeout_s = body_timeout_s


class H2Connection(asyncio.Protocol):
    def __init__(self, app: StreamApp, limits: Limits) -> None:
        self._app = app
        self._limits = limits
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._held = h2.Pending(len(h2.PREFACE))
        self._preface = False
        self._decoder = h2.HeaderDecoder(MAX_HEADER_LIST_SIZE)
        self.streams: dict[int, H2Stream] = {}
        self.quiet_since: float | None = None
        """``time.perf_counter()`` when the last stream open was done, the last time none
        was (None: never yet): a new stream's request came after it (api/overload.py)."""
        self._last_id = 0
        self._fragment: tuple[int, int, bytearray] | None = None  # (stream, flags, block)
        self._send = SendFlow(self._queue, self._sent_end)
        self._recv = RecvFlow(limits.window, self._queue)
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._closing = False
        self._heard = self._active = 0.0
        self._ping_sent: float | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._body_watch: asyncio.TimerHandle | None = None
        """Set while a stream holds part of a message: fires at the first one's deadline."""

    # --- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._heard = self._active = self._loop.time()
        limits = self._limits
        self._queue(h2.settings_frame({h2.MAX_CONCURRENT_STREAMS: limits.max_streams,
                                       h2.INITIAL_WINDOW_SIZE: limits.window,
                                       h2.MAX_FRAME_SIZE: MAX_FRAME_SIZE,
                                       h2.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_SIZE,
                                       h2.ENABLE_PUSH: 0}))
        if limits.window > h2.DEFAULT_WINDOW:
            self._queue(h2.window_update(0, limits.window - h2.DEFAULT_WINDOW))
        self._tick = self._loop.call_later(TICK_S, self._on_tick)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._tick is not None:
            self._tick.cancel()
        if self._body_watch is not None:
            self._body_watch.cancel()
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            if stream.sink is not None:
                stream.sink.reset()
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._heard = self._loop.time()
        try:
            whole = self._held.add(data)
            if whole is None:
                if not self._preface and not h2.PREFACE.startswith(b"".join(self._held.chunks)):
                    raise h2.ProtocolError("not an HTTP/2 connection preface")
                return
            data = whole
            if not self._preface:
                if not data.startswith(h2.PREFACE):
                    raise h2.ProtocolError("not an HTTP/2 connection preface")
                self._preface = True
                data = data[len(h2.PREFACE):]
            pos, size, need = 0, len(data), 9
            while size - pos >= 9:
                word, flags, stream_id = _FRAME.unpack_from(data, pos)
                length = word >> 8
                if length > MAX_FRAME_SIZE:
                    raise h2.ProtocolError("frame larger than SETTINGS_MAX_FRAME_SIZE",
                                           h2.FRAME_SIZE_ERROR)
                end = pos + 9 + length
                if end > size:
                    need = 9 + length
                    break
                self._frame(word & 0xFF, flags, stream_id & 0x7FFFFFFF, data[pos + 9:end])
                pos = end
            self._held.keep(data[pos:] if pos < size else b"", need)
        except h2.ProtocolError as exc:
            log.info("HTTP/2 connection error: %s", exc)
            self._fail(exc.code, str(exc))

    # --- what the application calls -----------------------------------------------------
    def send_headers(self, stream_id: int, block: bytes, end: bool = False) -> None:
        stream = self.streams.get(stream_id)
        if stream is None or not stream.sending:
            return
        if stream.pending:
            stream.pending.append((h2.HEADERS, block, end))
        else:
            self._queue(h2.frame(h2.HEADERS, h2.END_HEADERS | (h2.END_STREAM if end else 0),
                                 stream_id, block))
            if end:
                self._sent_end(stream_id, stream)

    def send_data(self, stream_id: int, payload: bytes, end: bool = False) -> None:
        stream = self.streams.get(stream_id)
        if stream is None or not stream.sending:
            return
        self._send.data(stream_id, stream, payload, end)

    def reset_stream(self, stream_id: int, code: int) -> None:
        if self.streams.pop(stream_id, None) is not None:
            self._queue(h2.rst_stream(stream_id, code))
            self._stream_gone()

    def credit(self, stream_id: int, size: int) -> None:
        """The application took ``size`` bytes of this stream's data: the peer may send more."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.held -= size  # what is left begins the next message
            stream.held_since = self._loop.time() if stream.held > 0 else None
        self._recv.credit(stream_id, stream, size)

    def shut_down(self) -> None:
        """GOAWAY: no new streams; the connection closes once its streams are done."""
        if not self._closing:
            self._closing = True
            self._queue(h2.goaway(self._last_id, h2.NO_ERROR))
        if not self.streams:
            self._close_after_flush()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # --- frames -------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._fragment is not None and kind != h2.CONTINUATION:
            raise h2.ProtocolError("a header block was interrupted")
        if kind == h2.DATA:
            self._data(flags, stream_id, payload)
        elif kind == h2.HEADERS:
            if stream_id == 0:
                raise h2.ProtocolError("HEADERS on stream 0")
            payload = self._unpadded(flags, payload)
            if flags & h2.PRIORITY_FLAG:
                payload = payload[5:]
            if flags & h2.END_HEADERS:
                self._headers(stream_id, flags, payload)
            else:
                self._fragment = (stream_id, flags, bytearray(payload))
        elif kind == h2.CONTINUATION:
            if self._fragment is None or self._fragment[0] != stream_id:
                raise h2.ProtocolError("CONTINUATION without its HEADERS")
            block = self._fragment[2]
            block += payload
            if len(block) > 4 * MAX_HEADER_LIST_SIZE:
                raise h2.ProtocolError("header block too large", h2.ENHANCE_YOUR_CALM)
            if flags & h2.END_HEADERS:
                first_flags = self._fragment[1]
                self._fragment = None
                self._headers(stream_id, first_flags, bytes(block))
        elif kind == h2.RST_STREAM:
            stream = self.streams.pop(stream_id, None)
            if stream is not None:
                if stream.sink is not None:
                    stream.sink.reset()
                self._stream_gone()
        elif kind == h2.SETTINGS:
            if not flags & h2.ACK:
                self._send.settings(h2.parse_settings(payload), self.streams)
                self._queue(h2.frame(h2.SETTINGS, h2.ACK, 0))
        elif kind == h2.PING:
            if len(payload) != 8:
                raise h2.ProtocolError("PING payload is not 8 bytes", h2.FRAME_SIZE_ERROR)
            if flags & h2.ACK:
                self._ping_sent = None
            else:
                self._queue(h2.frame(h2.PING, h2.ACK, 0, payload))
        elif kind == h2.WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            stream = self._send.window_update(stream_id, increment, self.streams)
            if stream is not None:
                self.reset_stream(stream_id, h2.FLOW_CONTROL_ERROR)
                if stream.sink is not None:
                    stream.sink.reset()
        elif kind == h2.GOAWAY:
            self._closing = True
            if not self.streams:
                self._close_after_flush()
        elif kind == h2.PUSH_PROMISE:
            raise h2.ProtocolError("a client sent PUSH_PROMISE")
        # PRIORITY and unknown frame types are ignored (RFC 9113 sections 5.5 and 6.3)

    @staticmethod
    def _unpadded(flags: int, payload: bytes) -> bytes:
        if not flags & h2.PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise h2.ProtocolError("padding longer than the frame")
        return payload[1:len(payload) - payload[0]]

    def _headers(self, stream_id: int, flags: int, block: bytes) -> None:
        headers = self._decoder.decode(block)  # always: the table must stay in step
        end = bool(flags & h2.END_STREAM)
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client: the body ends here
            if stream.receiving and stream.sink is not None:
                stream.receiving = False
                stream.sink.data(b"", True)
                self._received_end(stream_id, stream)
            return
        if stream_id % 2 == 0 or stream_id <= self._last_id:
            raise h2.ProtocolError(f"stream {stream_id} is not a new client stream")
        self._last_id = stream_id
        if self._closing or len(self.streams) >= self._limits.max_streams:
            self._queue(h2.rst_stream(stream_id, h2.REFUSED_STREAM))
            return
        self._active = self._loop.time()
        stream = H2Stream(None, self._send.peer_initial, self._limits.window)
        self.streams[stream_id] = stream
        stream.sink = self._app.open_stream(self, stream_id, headers)
        if end:
            stream.receiving = False
            stream.sink.data(b"", True)
            self._received_end(stream_id, stream)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise h2.ProtocolError("DATA on stream 0")
        size = len(payload)
        self._recv.take(size)
        stream = self.streams.get(stream_id)
        body = self._unpadded(flags, payload)
        if stream is None or not stream.receiving or stream.sink is None:
            if stream_id > self._last_id:
                raise h2.ProtocolError(f"DATA on idle stream {stream_id}")
            self.credit(0, size)  # a closed stream's bytes still used the connection window
            return
        stream.recv_window -= size
        if stream.recv_window < 0:
            self.reset_stream(stream_id, h2.FLOW_CONTROL_ERROR)
            stream.sink.reset()
            return
        if size > len(body):
            self.credit(0, size - len(body))  # padding is never handed on
        end = bool(flags & h2.END_STREAM)
        if not stream.held and body and not end:
            self._begin_message(stream)
        stream.held += len(body)
        if end:
            stream.receiving = False
            stream.sink.data(body, True)
            self._received_end(stream_id, stream)
        else:
            stream.sink.data(body, False)

    def _begin_message(self, stream: H2Stream) -> None:
        stream.held_since = now = self._loop.time()
        if self._body_watch is None:
            self._body_watch = self._loop.call_at(now + self._limits.body_timeout_s,
                                                  self._messages_late)

    def _messages_late(self) -> None:
        """Reset each stream whose message began ``body_timeout_s`` ago and is not whole;
        look again at the next such deadline."""
        self._body_watch = None
        timeout = self._limits.body_timeout_s
        now, first = self._loop.time(), None
        for stream_id, stream in list(self.streams.items()):
            since = stream.held_since
            if since is None or not stream.receiving:
                continue
            if since + timeout > now:
                first = since if first is None else min(first, since)
                continue
            body_timeouts.count("grpc")
            self.reset_stream(stream_id, h2.CANCEL)
            if stream.sink is not None:
                stream.sink.reset()
        if first is not None:
            self._body_watch = self._loop.call_at(first + timeout, self._messages_late)

    # --- stream ends -------------------------------------------------------------------
    def _sent_end(self, stream_id: int, stream: H2Stream) -> None:
        """Answered. A stream whose request has not ended stays until it does (its sink
        discards the rest): a RST_STREAM here would race the client's own writes, which
        some clients then report in place of the status they were sent."""
        stream.sending = False
        if not stream.receiving:
            self._close_stream(stream_id)

    def _received_end(self, stream_id: int, stream: H2Stream) -> None:
        stream.receiving = False
        if not stream.sending:
            self._close_stream(stream_id)

    def _close_stream(self, stream_id: int) -> None:
        if self.streams.pop(stream_id, None) is not None:
            self._stream_gone()

    def _stream_gone(self) -> None:
        if not self.streams:
            self._active = self._loop.time()
            self.quiet_since = time.perf_counter()
            if self._closing:
                self._close_after_flush()

    def _queue(self, data: bytes) -> None:
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(out) if len(out) > 1 else out[0])

    def _close_after_flush(self) -> None:
        self._loop.call_soon(self._loop.call_soon, self.close)

    def _fail(self, code: int, message: str) -> None:
        self._queue(h2.goaway(self._last_id, code, message.encode()[:200]))
        self._flush()
        self.close()

    def _on_tick(self) -> None:
        now = self._loop.time()
        limits = self._limits
        if self._ping_sent is not None and now - self._ping_sent > limits.keepalive_timeout_s:
            log.info("HTTP/2 peer did not answer a keepalive ping: closing")
            self.close()
            return
        if not self.streams and now - self._active > limits.idle_s:
            self.shut_down()
        elif self._ping_sent is None and now - self._heard > limits.keepalive_s:
            self._ping_sent = now
            self._queue(h2.frame(h2.PING, 0, 0, b"conveyor"))
        self._tick = self._loop.call_later(TICK_S, self._on_tick)
