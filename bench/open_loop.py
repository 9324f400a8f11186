"""A light open-loop HTTP/1.1 load generator: arrivals fixed in advance, answers timed from
the scheduled send time (no coordinated omission).

Cheap on purpose, because it shares a 2-core box with the server it measures: keep-alive
connections opened before the clock starts, one request body encoded once, responses parsed
only as far as the status line and ``content-length``, no HTTP client library. Each point
reports what the generator itself cost (its CPU seconds per wall second) and how late it
sent (send lag: actual send time minus the scheduled one), so a point where the generator
fell behind can be refused instead of believed.

Arrivals: :func:`poisson` at a constant rate, :func:`on_off` bursts (Poisson at a higher rate
while "on", silent while "off", the same mean).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast


def poisson(rate: float, seconds: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of a Poisson process at ``rate`` per second."""
    rng = random.Random(seed)
    out: list[float] = []
    at = rng.expovariate(rate) if rate > 0 else seconds
    while at < seconds:
        out.append(at)
        at += rng.expovariate(rate)
    return out


def on_off(rate: float, seconds: float, on_s: float = 0.1, off_s: float = 0.1,
           seed: int = 0) -> list[float]:
    """Bursts with mean ``rate``: Poisson at ``rate·(on_s + off_s)/on_s`` for ``on_s``, then
    nothing for ``off_s``, repeated."""
    period = on_s + off_s
    burst = poisson(rate * period / on_s, seconds * on_s / period, seed)
    return [(t // on_s) * period + t % on_s for t in burst]


@dataclass
class Outcome:
    """What one point's requests got: per answered request its status and latency (ms, from
    the scheduled time); requests with no answer (connection lost, or still waiting at the
    end) count in ``lost``."""

    latencies_ms: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    lost: int = 0
    sent: int = 0
    lag_ms: list[float] = field(default_factory=list)
    cpu_share: float = 0.0
    """The generator's CPU seconds per wall second over the point."""
    extra_connections: int = 0
    """Connections opened during the point because every pre-opened one was busy."""

    def good(self, target_ms: float) -> int:
        """Answers with status 200 within ``target_ms``."""
        return sum(1 for s, ms in zip(self.statuses, self.latencies_ms, strict=True)
                   if s == 200 and ms <= target_ms)

    def count(self, status: int) -> int:
        return self.statuses.count(status)

    def lag_p99_ms(self) -> float:
        if not self.lag_ms:
            return 0.0
        ordered = sorted(self.lag_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class _Connection(asyncio.Protocol):
    """One keep-alive connection with at most one request outstanding."""

    def __init__(self, on_answer: Callable[[_Connection, int, float], None]) -> None:
        self.on_answer = on_answer
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._scheduled = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, request: bytes, scheduled: float) -> None:
        assert self.transport is not None
        self._scheduled = scheduled
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self._buffer[:end]).lower()
        length = 0
        at = head.find(b"content-length:")
        if at >= 0:
            length = int(head[at + 15:].split(b"\r\n", 1)[0])
        if len(self._buffer) < end + 4 + length:
            return
        del self._buffer[:end + 4 + length]
        status = int(head[9:12])
        self.on_answer(self, status, self._scheduled)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.on_answer(self, -1, self._scheduled)


def pooled(outcomes: Sequence[Outcome]) -> Outcome:
    """Several runs of one policy at one point as one: their requests together, their
    CPU share the mean of theirs."""
    out = Outcome()
    for one in outcomes:
        out.latencies_ms += one.latencies_ms
        out.statuses += one.statuses
        out.lag_ms += one.lag_ms
        out.lost += one.lost
        out.sent += one.sent
        out.extra_connections += one.extra_connections
    out.cpu_share = sum(one.cpu_share for one in outcomes) / max(1, len(outcomes))
    return out


async def run(host: str, port: int, path: str, body: bytes, send_times: Sequence[float],
              connections: int, *, warmup_s: float = 0.0, drain_s: float = 5.0,
              content_type: str = "application/json") -> Outcome:
    """Send ``body`` to ``path`` at each of ``send_times`` (seconds from the start); count
    only those scheduled at or after ``warmup_s``. Waits at most ``drain_s`` after the last
    send for answers still due."""
    request = (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: {content_type}\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()
    out = Outcome()
    idle: deque[_Connection] = deque()
    outstanding: dict[_Connection, bool] = {}
    all_done = asyncio.Event()
    finished_sending = False

    connecting = waiting = 0
    """Requests waiting for a connection of their own to open; those of them counted."""

    def answered(conn: _Connection, status: int, scheduled: float) -> None:
        counted = outstanding.pop(conn, None)
        if counted is None:
            return
        if status < 0:
            out.lost += counted
        else:
            if counted:
                out.statuses.append(status)
                out.latencies_ms.append((time.perf_counter() - scheduled) * 1e3)
            idle.append(conn)
        settled()

    def settled() -> None:
        if finished_sending and not outstanding and not connecting:
            all_done.set()

    async def connect() -> _Connection:
        _, protocol = await loop.create_connection(lambda: _Connection(answered), host, port)
        return protocol

    async def send_on_new(scheduled: float, counted: bool) -> None:
        """Every connection busy: this request goes on a new one, opened beside the loop
        that sends the rest on time (a slow accept delays this request, timed from its
        schedule, not the ones after it)."""
        nonlocal connecting, waiting
        connecting += 1
        waiting += counted
        try:
            conn = await connect()
        except OSError:
            out.lost += counted
        else:
            outstanding[conn] = counted
            conn.send(request, scheduled)
        finally:
            connecting -= 1
            waiting -= counted
            settled()

    idle.extend(await asyncio.gather(*(connect() for _ in range(connections))))
    opening: set[asyncio.Task[None]] = set()
    cpu0, start = time.process_time(), time.perf_counter()
    for offset in send_times:
        scheduled = start + offset
        delay = scheduled - time.perf_counter()
        if delay > 0.0005:
            await asyncio.sleep(delay)
        while idle and idle[0].closed:
            idle.popleft()
        counted = offset >= warmup_s
        out.sent += counted
        if counted:
            out.lag_ms.append(max(0.0, time.perf_counter() - scheduled) * 1e3)
        if idle:
            conn = idle.popleft()
            outstanding[conn] = counted
            conn.send(request, scheduled)
        else:
            out.extra_connections += 1
            opening.add(task := loop.create_task(send_on_new(scheduled, counted)))
            task.add_done_callback(opening.discard)
    finished_sending = True
    if outstanding or connecting:
        try:
            await asyncio.wait_for(all_done.wait(), drain_s)
        except TimeoutError:
            out.lost += sum(outstanding.values()) + waiting  # those still connecting too
            for task in opening:
                task.cancel()
    wall = time.perf_counter() - start
    out.cpu_share = (time.process_time() - cpu0) / wall if wall > 0 else 0.0
    for conn in [*idle, *outstanding]:
        if conn.transport is not None:
            conn.transport.close()
    return out


async def closed(host: str, port: int, path: str, body: bytes, connections: int, seconds: float,
                 content_type: str = "application/json") -> Outcome:
    """Closed loop: each of ``connections`` sends its next request as soon as it is answered,
    for ``seconds``; latencies are from each send."""
    out = Outcome()
    request = (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: {content_type}\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()
    end = time.perf_counter() + seconds
    stopped = asyncio.Event()
    live = connections

    def answered(conn: _Connection, status: int, scheduled: float) -> None:
        nonlocal live
        if stopped.is_set():
            return
        if status < 0:
            out.lost += 1
        else:
            out.statuses.append(status)
            out.latencies_ms.append((time.perf_counter() - scheduled) * 1e3)
        now = time.perf_counter()
        if status >= 0 and now < end:
            out.sent += 1
            conn.send(request, now)
            return
        live -= 1
        if not live:
            stopped.set()

    conns = []
    for _ in range(connections):
        _, conn = await loop.create_connection(lambda: _Connection(answered), host, port)
        conns.append(conn)
    cpu0, start = time.process_time(), time.perf_counter()
    for conn in conns:
        out.sent += 1
        conn.send(request, time.perf_counter())
    try:
        await asyncio.wait_for(stopped.wait(), seconds + 10.0)
    finally:
        out.cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - start)
        for conn in conns:
            if conn.transport is not None:
                conn.transport.close()
    return out
