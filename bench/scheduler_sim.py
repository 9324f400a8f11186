"""A discrete-event model of one inference instance, to compare batching policies.

Pure and deterministic (numpy's seeded generator; no clock, no I/O). One device runs one
batch at a time; its batch latency is ``base + per_row·max(0, rows − knee)``: linear with
``knee = 0``, GPU-like (flat until the knee, then linear) otherwise.

Policies that implement ``batching.policy.Policy`` run in a model of the real inference loop
(``workers/inference.py``): a blocking read wakes at the first arrival; while the policy
waits the loop sleeps ``min(wait_s, 1 ms)`` and reads again without blocking; it holds at
most ``max_rows`` rows read, and rows that queue while a batch runs are read (``seen``)
when it ends. BentoML's CORK dispatcher, which owns its queue, drops requests and picks the
newest first, has its own model (``run_cork``), after ``bentoml/_internal/marshal/dispatcher.py``.

Metrics: goodput (share of offered requests answered within the latency target), p50/p99
of answered requests, throughput, mean batch.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from batching.adaptive import AdaptivePolicy
from batching.policy import Decision, FixedWindow, Policy
from batching.shedding import rows_in_time

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


def run_loop(arrivals: Sequence[float] | Stream, device: Device, policy: Policy, max_rows: int,
             timeout_s: float = 30.0, poll_s: float = POLL_S, overhead_s: float = 0.0) -> Outcome:
    """The inference loop with ``policy``: read, answer the expired and those the policy
    says cannot finish in time (without running them), decide, run or sleep. Each batch
    costs ``overhead_s`` beyond the device (reading, decoding, answering), and the policy
    observes the whole."""
    stream = arrivals if isinstance(arrivals, OpenStream | ClosedStream) else OpenStream(arrivals)
    done: list[float] = []
    pending: deque[tuple[float, float]] = deque()  # (arrival, seen), oldest first
    out = Outcome(np.empty(0))
    now = 0.0
    expired = 0
    while True:
        if not pending:  # nothing read: the blocking read wakes at the next arrival
            nxt = stream.next_arrival()
            if nxt is None:
                break
            now = max(now, nxt)
        room = max_rows - len(pending)
        got = stream.read(now, room)
        backlog = len(got) >= room
        if got:
            pending.extend((t, now) for t in got)
            policy.observe_arrivals(len(got), now)
        threshold, in_time = now, max_rows
        if backlog and policy.shed_horizon_s(1) > 0.0:
            in_time, threshold = rows_in_time(((t + timeout_s, 1) for t, _ in pending), now,
                                              policy.shed_horizon_s, max_rows)
            in_time = in_time or max_rows
        while pending and pending[0][0] + timeout_s <= threshold:
            pending.popleft()  # answered with a timeout, never run
            expired += 1
        if not pending:
            continue
        decision: Decision = policy.decide(now, len(pending), pending[0][1], pending[0][0] + timeout_s)
        if decision.dispatch:
            rows = min(len(pending), decision.max_rows or max_rows, in_time)
            took = device.seconds(rows) + overhead_s
            now += took
            done.extend(now - pending.popleft()[0] for _ in range(rows))
            policy.observe_batch(rows, took, now)
            stream.answered(now, rows)
            out.batches.append(rows)
            out.reasons[decision.reason] += 1
        else:
            now += max(min(decision.wait_s, poll_s), 1e-6)
    out.latency = np.concatenate([np.asarray(done), np.full(expired, math.inf)])
    out.span_s = now
    return out


@dataclass(slots=True)
class LitServeWindow:
    """LitServe's batched loop: each collection window of ``timeout_s`` starts when the last
    one ended (after a batch, or empty), not at the first request, and ends early only when
    ``max_rows`` are in."""

    max_rows: int
    timeout_s: float
    row_cap: int | None = None
    _window_start: float = 0.0

    def decide(self, now: float, rows: int, first_seen: float, earliest_deadline: float) -> Decision:
        if rows >= self.max_rows:
            return Decision(True, reason="full")
        if self.timeout_s <= 0:
            return Decision(True, reason="window")
        # Empty windows roll over: the one that catches the first row ends on the grid.
        periods = max(1, math.ceil((first_seen - self._window_start) / self.timeout_s))
        closes = self._window_start + periods * self.timeout_s
        if now >= closes:
            return Decision(True, reason="window")
        return Decision(False, wait_s=closes - now)

    def observe_batch(self, rows: int, seconds: float, now: float) -> None:
        self._window_start = now

    def observe_arrivals(self, count: int, now: float) -> None:
        pass

    def estimates(self) -> dict[str, float]:
        return {}

    def shed_horizon_s(self, rows: int) -> float:
        """LitServe runs every request it takes."""
        return 0.0


@dataclass(slots=True)
class _CorkOptimizer:
    """BentoML's ``Optimizer``: duration = o_a·n + o_b by least squares over the last 50
    batches (the first 2 skipped), refreshed at most every 5 s; ``wait`` is the mean time
    the oldest request of a batch had waited when it went."""

    max_latency_s: float
    o_a: float = 0.0
    o_b: float = 0.0
    wait: float = 0.01
    counter: int = 0
    stats: deque[tuple[int, float, float]] = field(default_factory=lambda: deque(maxlen=50))
    _tokens: float = 2.0
    _last_consume: float = 0.0

    def __post_init__(self) -> None:
        self.o_a = min(2.0, self.max_latency_s * 2.0 / 30)
        self.o_b = min(1.0, self.max_latency_s * 1.0 / 30)

    def log(self, n: int, wait: float, duration: float, now: float) -> None:
        if self.counter <= 2 + 4:
            self.counter += 1
            if self.counter <= 2:
                return
        self.stats.append((n, duration, wait))
        tokens = min(self._tokens + (now - self._last_consume) / 5.0, 1.0)
        if tokens >= 1.0:
            self._tokens = tokens - 1.0
            self._last_consume = now
            self.refresh()

    def refresh(self) -> None:
        if not self.stats:
            return
        x = np.array([(n, 1.0) for n, _, _ in self.stats])
        y = np.array([d for _, d, _ in self.stats])
        o_a, o_b = np.linalg.lstsq(x, y, rcond=None)[0]
        self.o_a, self.o_b = max(1e-6, float(o_a)), max(0.0, float(o_b))
        self.wait = max(0.0, sum(w for _, _, w in self.stats) / len(self.stats))


def run_cork(arrivals: Sequence[float], device: Device, max_rows: int, max_latency_s: float,
             tick_s: float = 0.001) -> Outcome:
    """BentoML's CORK dispatcher (``CorkDispatcher.controller``) with one batch in flight.

    Warm-up serves 1, 1, 1, 1, then up to 2, then up to 3 requests; then, every tick: drop
    the oldest while ``w0 + o_a·n + o_b ≥ max_latency`` (a 503 to its client); keep waiting
    while ``n·(wn + tick + o_a) ≤ 0.95·wait``; else run up to ``max_rows − 1`` requests,
    newest first, as BentoML's ``deque.pop()`` does.
    """
    arr = np.asarray(arrivals, dtype=np.float64)
    n_total = len(arr)
    latency = np.full(n_total, math.inf)
    out = Outcome(latency)
    opt = _CorkOptimizer(max_latency_s)
    queue: deque[int] = deque()
    read = 0
    now = 0.0
    inflight: tuple[float, float, list[int]] | None = None  # (start, end, rows)
    phase = 1
    step_wait = 0.0
    limit = max_latency_s

    def finish() -> None:
        nonlocal inflight
        assert inflight is not None
        start, end, chosen = inflight
        for i in chosen:
            latency[i] = end - arr[i]
        opt.log(len(chosen), start - arr[chosen[-1]], end - start, end)
        inflight = None

    while read < n_total or queue or inflight is not None:
        if inflight is not None and inflight[1] <= now:
            finish()
        while read < n_total and arr[read] <= now:
            queue.append(read)
            read += 1
        if not queue:  # wait for the next arrival; a running batch finishes on its own
            if read < n_total:
                if inflight is not None and inflight[1] <= arr[read]:
                    now = inflight[1]
                    finish()
                now = max(now, float(arr[read]))
            elif inflight is not None:
                now = inflight[1]
            continue
        c = opt.counter
        if phase == 1 and c > 2:
            phase = 2
        if phase == 2 and c > 3:
            opt.refresh()
            phase, step_wait = 3, min(limit * 0.95, 5 * (opt.o_a + opt.o_b))
        if phase == 3 and c > 4:
            opt.refresh()
            phase, step_wait = 4, min(limit * 0.95, 7 * (opt.o_a + opt.o_b))
        if phase == 4 and c > 5:
            opt.refresh()
            phase = 5
        n = len(queue)
        w0 = now - arr[queue[0]]
        a, b = opt.o_a, opt.o_b
        locked = inflight is not None
        if phase < 5:
            drop_over = {1: 2 - c + 6, 2: 6, 3: 5, 4: 3}[phase]
            if n > drop_over and w0 >= limit:
                queue.popleft()
                continue
            want = {1: 1, 2: 1, 3: 2, 4: 3}[phase]
            if phase >= 3 and n < want and (want * a + b) + w0 <= step_wait:
                now += tick_s
                continue
            if locked:
                now += tick_s
                continue
            take = min(n, want)
        else:
            if n > 1 and w0 + a * n + b >= limit:
                queue.popleft()
                continue
            if locked:
                if n == 1 and w0 >= limit:
                    queue.popleft()
                    continue
                now += tick_s
                continue
            wn = now - arr[queue[-1]]
            if n < max_rows and n * (wn + tick_s + a) <= opt.wait * 0.95:
                now += tick_s
                continue
            take = max(1, min(n, max_rows - 1))
        chosen = [queue.pop() for _ in range(take)]
        inflight = (now, now + device.seconds(take), chosen)
        out.batches.append(take)
        out.reasons["cork"] += 1
    out.span_s = max(now, float(arr[-1])) if n_total else 0.0
    return out


@dataclass(frozen=True, slots=True)
class Scenario:
    device: Device
    max_rows: int = 64
    target_s: float = 0.025
    adaptive_bound_s: float = 0.02
    """The adaptive policy's ``max_queue_delay_us``: a bound, not a wait."""


Runner = Callable[[Sequence[float], Scenario], Outcome]
MakePolicy = Callable[[Scenario], Policy]

LOOP_POLICIES: dict[str, MakePolicy] = {
    "fixed 0": lambda s: FixedWindow(s.max_rows, 0.0),
    "fixed 100 µs": lambda s: FixedWindow(s.max_rows, 0.0001),
    "fixed 1 ms": lambda s: FixedWindow(s.max_rows, 0.001),
    "fixed 5 ms": lambda s: FixedWindow(s.max_rows, 0.005),
    "Ray Serve 10 ms": lambda s: FixedWindow(s.max_rows, 0.01),
    "LitServe 10 ms": lambda s: LitServeWindow(s.max_rows, 0.01),
    "fixed 20 ms": lambda s: FixedWindow(s.max_rows, 0.02),
    "adaptive": lambda s: AdaptivePolicy(s.max_rows, s.adaptive_bound_s, latency_target_s=s.target_s),
}
"""Policies run in the model of our inference loop. Ray Serve's ``@serve.batch`` times its
wait from the first request it takes, as Triton does, so it is a fixed window here (its
defaults: ``batch_wait_timeout_s=0.01``, ``max_batch_size=10``; every contender gets the
scenario's ``max_rows``). LitServe's ``batch_timeout`` (default 0) is set to 10 ms."""


def _loop(name: str) -> Runner:
    make = LOOP_POLICIES[name]
    return lambda arrivals, s: run_loop(arrivals, s.device, make(s), s.max_rows)


CONTENDERS: dict[str, Runner] = {
    **{name: _loop(name) for name in ("fixed 0", "fixed 100 µs", "fixed 1 ms", "fixed 5 ms",
                                       "Ray Serve 10 ms", "LitServe 10 ms")},
    "CORK": lambda arrivals, s: run_cork(arrivals, s.device, s.max_rows, s.target_s),
    "adaptive": _loop("adaptive"),
}
FIXED = ("fixed 0", "fixed 100 µs", "fixed 1 ms", "fixed 5 ms")


@dataclass(frozen=True, slots=True)
class Result:
    device: str
    trace: str
    policy: str
    goodput: float
    """Share of offered requests answered within the target."""
    p50_s: float
    p99_s: float
    """Of answered requests."""
    throughput: float
    """Answered rows per second."""
    mean_batch: float
    dropped: int

    @property
    def meets_target(self) -> bool:
        """p99 of all offered requests (unanswered ones count as late) within the target."""
        return self.goodput >= 0.99


def _result(device: str, trace: str, policy: str, outcome: Outcome, target_s: float) -> Result:
    answered = len(outcome.latency) - outcome.dropped
    return Result(device, trace, policy, outcome.goodput(target_s), outcome.percentile(50),
                  outcome.percentile(99), answered / outcome.span_s if outcome.span_s else 0.0,
                  outcome.mean_batch, outcome.dropped)


def evaluate(scenario: Scenario, duration_s: float = 2.0, seed: int = 0,
             policies: Sequence[str] = tuple(CONTENDERS)) -> list[Result]:
    """Every policy on every trace (open loop: arrivals do not wait for answers)."""
    results = []
    for trace in traces(scenario.device.capacity(scenario.max_rows), duration_s, seed):
        for name in policies:
            outcome = CONTENDERS[name](trace.arrivals, scenario)
            results.append(_result(scenario.device.name, trace.name, name, outcome, scenario.target_s))
    return results


def evaluate_closed(scenario: Scenario, clients: Sequence[int] = (1, 4, 16, 64),
                    overhead_s: float = 0.001, duration_s: float = 2.0,
                    policies: Sequence[str] = ("fixed 0", "fixed 20 ms", "adaptive")) -> list[Result]:
    """Closed loop, as a benchmark client drives it: each of ``clients`` sends its next request
    ``overhead_s`` (API and network, outside the inference process) after its last answer."""
    results = []
    for count in clients:
        for name in policies:
            stream = ClosedStream(count, overhead_s, duration_s)
            policy = LOOP_POLICIES[name](scenario)
            outcome = run_loop(stream, scenario.device, policy, scenario.max_rows)
            label = f"{count} client" + ("s" if count != 1 else "")
            results.append(_result(scenario.device.name, label, name, outcome, scenario.target_s))
    return results


def _header(scenario: Scenario) -> str:
    device = scenario.device
    return (f"**{device.name}**: {device.describe()}; capacity "
            f"{device.capacity(scenario.max_rows):.0f} rows/s; max batch {scenario.max_rows}; "
            f"target {scenario.target_s * 1e3:g} ms; adaptive bound "
            f"(`max_queue_delay_us`) {scenario.adaptive_bound_s * 1e6:.0f}.")


def _grid(results: Sequence[Result], cell: Callable[[Result], str], corner: str) -> list[str]:
    names = list(dict.fromkeys(r.policy for r in results))
    rows = list(dict.fromkeys(r.trace for r in results))
    by = {(r.trace, r.policy): r for r in results}
    lines = [f"| {corner} | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(cell(by[(row, name)]) for name in names) + " |")
    return lines


def markdown(scenario: Scenario, results: Sequence[Result]) -> str:
    """A row per trace, a column per policy; cells ``goodput % / p99 ms (mean batch)``."""
    def cell(r: Result) -> str:
        mark = "†" if r.dropped else ""
        return f"{r.goodput * 100:.1f}{mark} / {r.p99_s * 1e3:.1f} ({r.mean_batch:.0f})"

    return "\n".join([_header(scenario), "", *_grid(results, cell, "trace")])


def markdown_closed(scenario: Scenario, results: Sequence[Result], overhead_s: float) -> str:
    """A row per client count; cells ``p50 ms / rows/s (mean batch)``."""
    def cell(r: Result) -> str:
        return f"{r.p50_s * 1e3:.1f} / {r.throughput:.0f} ({r.mean_batch:.1f})"

    return "\n".join([_header(scenario) + f" Overhead outside the worker {overhead_s * 1e3:g} ms.",
                      "", *_grid(results, cell, "closed loop")])


OPEN_SCENARIOS = (Scenario(LINEAR), Scenario(KNEE))
CLOSED_SCENARIO = Scenario(MLP_MEDIUM_CPU, target_s=0.05)


def report(duration_s: float = 2.0, seed: int = 0) -> str:
    """The tables of ``docs/batching.md``."""
    parts = []
    for scenario in OPEN_SCENARIOS:
        parts.append(markdown(scenario, evaluate(scenario, duration_s, seed)))
    overhead = 0.001
    parts.append(markdown_closed(CLOSED_SCENARIO,
                                 evaluate_closed(CLOSED_SCENARIO, overhead_s=overhead,
                                                 duration_s=duration_s), overhead))
    return "\n\n".join(parts) + "\n"
