"""Other servers' batching loops, as the simulator (bench/scheduler_sim.py) models them.

LitServe's collection window runs in the model of conveyor's inference loop, as a
``batching.policy.Policy``; BentoML's CORK dispatcher, which owns its queue, drops
requests and picks the newest first, has its own model (``run_cork``), after
``bentoml/_internal/marshal/dispatcher.py``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from batching.policy import Decision
from bench.scheduler_sim import Device, Outcome


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

    def observe_path(self, seconds: float) -> None:
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
