"""HTTP/2 flow control both ways (RFC 9113 section 5.2) for :mod:`api.h2_connection`.

:class:`SendFlow` keeps what the peer lets us send: the connection's window, its
initial stream window and largest frame (both from its SETTINGS). DATA that does not
fit waits in its stream's pending frames, with any HEADERS queued behind it, until a
WINDOW_UPDATE or SETTINGS makes room. :class:`RecvFlow` keeps what we let the peer send
on the connection, and credits it back, connection and stream, as the application takes
the data: in WINDOW_UPDATEs of at least a quarter of the window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from api import h2_codec as h2

if TYPE_CHECKING:
    from api.h2_connection import StreamSink


class H2Stream:
    """One open stream: its sink, both windows, the frames waiting for send window, which
    directions are still open, and the received bytes the application has not taken yet
    (a message not whole) with since when (``loop.time()``; None: none held)."""

    __slots__ = (
        "held",
        "held_since",
        "pending",
        "receiving",
        "recv_credit",
        "recv_window",
        "send_window",
        "sending",
        "sink",
    )

    def __init__(self, sink: StreamSink | None, send_window: int, recv_window: int) -> None:
        self.sink = sink
        self.send_window = send_window
        self.recv_window = recv_window
        self.pending: deque[tuple[int, bytes, bool]] = deque()  # (frame type, payload, end)
        self.receiving = True
        self.sending = True
        self.recv_credit = 0
        self.held = 0
        self.held_since: float | None = None


class SendFlow:
    """The send side of one connection. ``queue`` takes a frame to write; ``sent_end`` is
    told when a stream's last frame was queued."""

    def __init__(self, queue: Callable[[bytes], None],
                 sent_end: Callable[[int, H2Stream], None]) -> None:
        self._queue = queue
        self._sent_end = sent_end
        self.window = h2.DEFAULT_WINDOW
        self.peer_initial = h2.DEFAULT_WINDOW
        self.peer_frame = h2.DEFAULT_FRAME_SIZE

    def data(self, stream_id: int, stream: H2Stream, payload: bytes, end: bool) -> None:
        size = len(payload)
        if (not stream.pending and size <= stream.send_window and size <= self.window
                and size <= self.peer_frame):
            stream.send_window -= size
            self.window -= size
            self._queue(h2.frame(h2.DATA, h2.END_STREAM if end else 0, stream_id, payload))
            if end:
                self._sent_end(stream_id, stream)
            return
        stream.pending.append((h2.DATA, payload, end))
        self.drain(stream_id, stream)

    def settings(self, values: dict[int, int], streams: dict[int, H2Stream]) -> None:
        window = values.get(h2.INITIAL_WINDOW_SIZE)
        if window is not None:
            if window > h2.MAX_WINDOW:
                raise h2.ProtocolError("SETTINGS_INITIAL_WINDOW_SIZE too large",
                                       h2.FLOW_CONTROL_ERROR)
            delta, self.peer_initial = window - self.peer_initial, window
            for stream in streams.values():
                stream.send_window += delta
        frame_size = values.get(h2.MAX_FRAME_SIZE)
        if frame_size is not None:
            if not h2.DEFAULT_FRAME_SIZE <= frame_size <= 2**24 - 1:
                raise h2.ProtocolError("SETTINGS_MAX_FRAME_SIZE out of range")
            self.peer_frame = frame_size
        if window is not None:
            self.drain_all(streams)

    def window_update(self, stream_id: int, increment: int,
                      streams: dict[int, H2Stream]) -> H2Stream | None:
        """Apply a WINDOW_UPDATE; the stream whose window it took past 2^31-1 is returned,
        for the connection to reset."""
        if increment == 0:
            raise h2.ProtocolError("WINDOW_UPDATE of 0")
        if stream_id == 0:
            self.window += increment
            if self.window > h2.MAX_WINDOW:
                raise h2.ProtocolError("connection window over 2^31-1", h2.FLOW_CONTROL_ERROR)
            self.drain_all(streams)
            return None
        stream = streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            if stream.send_window > h2.MAX_WINDOW:
                return stream
            self.drain(stream_id, stream)
        return None

    def drain_all(self, streams: dict[int, H2Stream]) -> None:
        for stream_id, stream in list(streams.items()):
            if stream.pending:
                self.drain(stream_id, stream)

    def drain(self, stream_id: int, stream: H2Stream) -> None:
        pending = stream.pending
        while pending:
            kind, payload, end = pending[0]
            if kind == h2.HEADERS:
                pending.popleft()
                self._queue(h2.frame(h2.HEADERS, h2.END_HEADERS | (h2.END_STREAM if end else 0),
                                     stream_id, payload))
            else:
                room = min(stream.send_window, self.window, self.peer_frame)
                if room <= 0 and payload:
                    return
                chunk, rest = payload[:room], payload[room:]
                stream.send_window -= len(chunk)
                self.window -= len(chunk)
                last = end and not rest
                self._queue(h2.frame(h2.DATA, h2.END_STREAM if last else 0, stream_id, chunk))
                if rest:
                    pending[0] = (kind, rest, end)
                    continue
                pending.popleft()
            if end:
                self._sent_end(stream_id, stream)
                return


class RecvFlow:
    """The receive side of one connection, whose window is ``window`` (what its SETTINGS
    and first WINDOW_UPDATE announced)."""

    def __init__(self, window: int, queue: Callable[[bytes], None]) -> None:
        self._queue = queue
        self._size = window
        self.window = window
        self._credit = 0

    def take(self, size: int) -> None:
        """``size`` bytes of DATA arrived on the connection."""
        self.window -= size
        if self.window < 0:
            raise h2.ProtocolError("DATA beyond the connection window", h2.FLOW_CONTROL_ERROR)

    def credit(self, stream_id: int, stream: H2Stream | None, size: int) -> None:
        self._credit += size
        if self._credit >= self._size // 4:
            self._queue(h2.window_update(0, self._credit))
            self.window += self._credit
            self._credit = 0
        if stream is not None and stream.receiving:
            stream.recv_credit += size
            if stream.recv_credit >= self._size // 4:
                self._queue(h2.window_update(stream_id, stream.recv_credit))
                stream.recv_window += stream.recv_credit
                stream.recv_credit = 0
