"""A discrete-event model of one inference instance, to compare batching policies.

Pure and deterministic (numpy's seeded generator; no clock, no I/O). One device runs one
batch at a time; its batch latency is ``base + per_row·max(0, rows − knee)``: linear with
``knee = 0``, GPU-like (flat until the knee, then linear) otherwise.

Policies that implement ``batching.policy.Policy`` run in a model of the real inference loop
(``workers/inference.py``): a blocking read wakes at the first arrival; while the policy
waits the loop sleeps ``min(wait_s, 1 ms)`` and reads again without blocking; it holds at
most ``max_rows`` rows read, and rows that queue while a batch runs are read (``seen``)
when it ends. BentoML's CORK dispatcher, which owns its queue, drops requests and picks the
newest first, has its own model (``bench.peer_batchers.run_cork``); the scenarios and the
report are in bench/sim_scenarios.py.

Metrics: goodput (share of offered requests answered within the latency target), p50/p99
of answered requests, throughput, mean batch.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from batching.policy import Decision, Policy
from batching.shedding import rows_in_time
from workers.expiry import OVERLOAD_READ

POLL_S = 0.001
"""The inference loop's longest local sleep between reads while a policy waits."""



@dataclass(frozen=True, slots=True)
class Device:
    """Batch latency ``base + per_row·max(0, rows − knee)``, or measured ``points``
    ((rows, seconds), interpolated linearly, extrapolated from the last two)."""

    name: str
    base_s: float = 0.0
    per_row_s: float = 0.0
    knee: int = 0
    points: tuple[tuple[int, float], ...] = ()

    def seconds(self, rows: int) -> float:
        if not self.points:
            return self.base_s + self.per_row_s * max(0, rows - self.knee)
        pts = self.points
        if rows <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in itertools.pairwise(pts):
            if rows <= n1:
                return t0 + (t1 - t0) * (rows - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (rows - n1) / (n1 - n0)

    def capacity(self, max_rows: int) -> float:
        """Rows per second at the most efficient batch size, back to back."""
        return max(n / self.seconds(n) for n in range(1, max_rows + 1))

    def describe(self) -> str:
        if self.points:
            return "measured: " + ", ".join(f"t({n}) = {t * 1e3:.1f} ms" for n, t in self.points)
        if self.knee:
            return (f"t(n) = {self.base_s * 1e3:g} ms up to {self.knee} rows, then "
                    f"+{self.per_row_s * 1e3:g} ms/row")
        return f"t(n) = {self.base_s * 1e3:g} ms + {self.per_row_s * 1e3:g} ms·n"


LINEAR = Device("linear", 0.002, 0.00015)
"""CPU-like: t(1) = 2.15 ms, t(64) = 11.6 ms."""
KNEE = Device("gpu-knee", 0.004, 0.0001, knee=32)
"""GPU-like: 4 ms flat up to 32 rows, then 0.1 ms a row: t(64) = 7.2 ms."""
MLP_MEDIUM_CPU = Device("mlp_medium-cpu", points=(
    (1, 0.0048), (2, 0.0110), (4, 0.0103), (8, 0.0120), (16, 0.0145), (32, 0.0200), (64, 0.0304)))
"""bench's mlp_medium, TorchScript on one CPU thread, measured once on the dev box (batch 1
takes a faster matrix-vector path)."""


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    arrivals: tuple[float, ...]
    """Arrival times in seconds, sorted; one row each."""


def poisson(rng: np.random.Generator, rate: float, start: float, stop: float) -> list[float]:
    if rate <= 0 or stop <= start:
        return []
    count = int(rng.poisson(rate * (stop - start)))
    return sorted(float(t) for t in rng.uniform(start, stop, count))


def traces(capacity: float, duration_s: float = 2.0, seed: int = 0) -> list[Trace]:
    """Poisson at 10%–95% of ``capacity`` (rows/s), bursts, and on/off; the same for any policy."""
    out = []
    for i, load in enumerate((0.10, 0.30, 0.50, 0.70, 0.85, 0.95)):
        rng = np.random.default_rng([seed, i])
        out.append(Trace(f"poisson {round(load * 100)}%",
                         tuple(poisson(rng, load * capacity, 0.0, duration_s))))
    rng = np.random.default_rng([seed, 100])
    times = poisson(rng, 0.3 * capacity, 0.0, duration_s)
    start = 0.1
    while start < duration_s:  # 30 ms at 200% of capacity every 250 ms
        times += poisson(rng, 2.0 * capacity, start, min(start + 0.03, duration_s))
        start += 0.25
    out.append(Trace("bursts", tuple(sorted(times))))
    rng = np.random.default_rng([seed, 200])
    times = []
    start = 0.0
    while start < duration_s:  # 100 ms at 90% of capacity, then 100 ms silent
        times += poisson(rng, 0.9 * capacity, start, min(start + 0.1, duration_s))
        start += 0.2
    out.append(Trace("on/off", tuple(times)))
    return out


@dataclass(slots=True)
class Outcome:
    latency: npt.NDArray[np.float64]
    """Per offered request, seconds from arrival to answer; inf when never answered."""
    batches: list[int] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    span_s: float = 0.0

    def goodput(self, target_s: float) -> float:
        if not len(self.latency):
            return 1.0
        return float(np.mean(self.latency <= target_s))

    def percentile(self, q: float) -> float:
        answered = self.latency[np.isfinite(self.latency)]
        return float(np.percentile(answered, q)) if len(answered) else math.inf

    @property
    def dropped(self) -> int:
        return int(np.sum(~np.isfinite(self.latency)))

    @property
    def mean_batch(self) -> float:
        return float(np.mean(self.batches)) if self.batches else 0.0


class OpenStream:
    """Requests whose arrival times are fixed in advance (a trace)."""

    def __init__(self, arrivals: Sequence[float]) -> None:
        self.arrivals = arrivals
        self._next = 0

    def next_arrival(self) -> float | None:
        return self.arrivals[self._next] if self._next < len(self.arrivals) else None

    def read(self, now: float, limit: int) -> list[float]:
        end = min(bisect.bisect_right(self.arrivals, now, self._next), self._next + limit)
        out = list(self.arrivals[self._next:end])
        self._next = end
        return out

    def answered(self, at: float, count: int) -> None:
        pass


class ClosedStream:
    """``clients`` that each send their next request ``overhead_s`` after the last answer
    (the API and network round trip outside the inference process), until ``duration_s``."""

    def __init__(self, clients: int, overhead_s: float, duration_s: float) -> None:
        self.overhead_s = overhead_s
        self.duration_s = duration_s
        self._heap = [overhead_s / 2 + i * 1e-6 for i in range(clients)]
        heapq.heapify(self._heap)

    def next_arrival(self) -> float | None:
        return self._heap[0] if self._heap else None

    def read(self, now: float, limit: int) -> list[float]:
        out: list[float] = []
        while self._heap and self._heap[0] <= now and len(out) < limit:
            out.append(heapq.heappop(self._heap))
        return out

    def answered(self, at: float, count: int) -> None:
        if at + self.overhead_s < self.duration_s:
            for _ in range(count):
                heapq.heappush(self._heap, at + self.overhead_s)


Stream = OpenStream | ClosedStream


@dataclass(slots=True)
class Standing:
    """Past capacity as workers/expiry.py judges it, for :func:`run_loop`'s ``target_s``:
    every read full for as long as the target with the oldest waiting longer than it,
    until the queue has stayed drained as long."""

    target_s: float
    on: bool = False
    _full_since: float | None = None
    _drained_since: float | None = None

    def read(self, full: bool, oldest_wait_s: float, now: float) -> None:
        if not full:
            self._full_since = None
        elif self._full_since is None:
            self._full_since = now
        elif now - self._full_since >= self.target_s and oldest_wait_s >= self.target_s:
            self.on, self._drained_since = True, None

    def left(self, waiting: int, now: float) -> None:
        if waiting or self._full_since is not None:
            self._drained_since = None
        elif self._drained_since is None:
            self._drained_since = now
        elif now - self._drained_since >= self.target_s:
            self.on = False


def run_loop(arrivals: Sequence[float] | Stream, device: Device, policy: Policy, max_rows: int,
             timeout_s: float = 30.0, poll_s: float = POLL_S, overhead_s: float = 0.0,
             target_s: float | None = None) -> Outcome:
    """The inference loop with ``policy``: read, answer the expired and those the policy
    says cannot finish in time (without running them), decide, run or sleep. Each batch
    costs ``overhead_s`` beyond the device (reading, decoding, answering), and the policy
    observes the whole. With ``target_s`` (the adaptive policy's ``batching.overload:
    lifo``) a request is due by the sooner of its timeout and the target, and past
    capacity (:class:`Standing`) the loop reads up to ``OVERLOAD_READ`` batches, serves the
    newest first and answers at once what cannot be answered by its due time."""
    stream = arrivals if isinstance(arrivals, OpenStream | ClosedStream) else OpenStream(arrivals)
    done: list[float] = []
    pending: deque[tuple[float, float]] = deque()  # (arrival, seen), oldest first
    out = Outcome(np.empty(0))
    now = 0.0
    expired = 0
    standing = None if target_s is None else Standing(target_s)
    due = timeout_s if target_s is None else min(timeout_s, target_s)
    while True:
        if not pending:  # nothing read: the blocking read wakes at the next arrival
            nxt = stream.next_arrival()
            if nxt is None:
                break
            now = max(now, nxt)
        lifo = standing is not None and standing.on
        room = max_rows * (OVERLOAD_READ if lifo else 1) - len(pending)
        got = stream.read(now, room)
        backlog = len(got) >= room
        if got:
            pending.extend((t, now) for t in got)
            policy.observe_arrivals(len(got), now)
        if standing is not None:
            standing.read(backlog, now - pending[0][0] if pending else 0.0, now)
        cut, threshold, in_time = timeout_s, now, max_rows
        if (backlog if standing is None else standing.on) and policy.shed_horizon_s(1) > 0.0:
            for cut in dict.fromkeys((due, timeout_s)):  # the target, else deadlines only
                in_time, threshold = rows_in_time(((t + cut, 1) for t, _ in pending), now,
                                                  policy.shed_horizon_s, max_rows)
                if in_time:
                    break
            in_time = in_time or max_rows
        while pending and pending[0][0] + cut <= threshold:
            pending.popleft()  # answered with a timeout, never run
            expired += 1
        if not pending:
            if standing is not None:
                standing.left(0, now)
            continue
        decision: Decision = policy.decide(now, len(pending), pending[0][1], pending[0][0] + due)
        if decision.dispatch:
            rows = min(len(pending), decision.max_rows or max_rows, in_time)
            took = device.seconds(rows) + overhead_s
            now += took
            take = pending.pop if standing is not None and standing.on else pending.popleft
            done.extend(now - take()[0] for _ in range(rows))
            policy.observe_batch(rows, took, now)
            stream.answered(now, rows)
            out.batches.append(rows)
            out.reasons[decision.reason] += 1
            if standing is not None:
                standing.left(len(pending), now)
        else:
            now += max(min(decision.wait_s, poll_s), 1e-6)
    out.latency = np.concatenate([np.asarray(done), np.full(expired, math.inf)])
    out.span_s = now
    return out
