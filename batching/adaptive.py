"""The adaptive batching policy: learn the device, estimate the load, wait only when it pays.

Pure, like every policy: each method is handed the time it should use and nothing here reads
a clock, so a test or the simulator (``bench.scheduler_sim``) drives it with any timeline.

The rule, for the head shape group of ``n`` rows on an idle device (the inference loop only
asks while nothing runs):

* ``t(n) = a + b·n`` is fitted online (exponentially weighted least squares) from the batches
  this instance ran; ``λ`` (rows/s) is an exponentially decayed count of the rows read.
* Dispatching ``n`` rows keeps up with arrivals when ``n / t(n) ≥ λ``, that is when
  ``n ≥ n* = λ·a / (1 − λ·b)``. At or above ``n*`` waiting only adds latency. Below it the
  device runs batches too small to keep up; but requests then queue while it runs, so the
  next batch is bigger anyway ("natural batching" closes the gap within a batch or two).
  The simulator shows that waiting pays only when the shortfall is large: the policy waits
  while ``shortfall·(n + 1) ≤ n*`` (``shortfall = 1.5``). That is where closed-loop clients
  otherwise split into two half batches that alternate. At low load ``n* < 3``: a lone
  request goes at once. Past what even full batches keep up with (``n* ≥ max_batch_size``,
  or ``λ·b ≥ 1``) nothing waits either: the queue grows while a batch runs, so the next
  batch is as big as it can be, and a wait would only idle the device (mlp_medium on a
  2-core host at 110% of its capacity: a quarter of the answers went late while it waited
  for 42 rows).
* A wait must also leave the oldest request finishing within ``slack × latency_target`` and
  before its deadline, given the expected arrivals and ``t(n)``; it never outlasts
  ``max_queue_delay_us``, and it gives up as soon as arrivals stop (the rate estimate falls
  to ``1/gap`` once the gap since the last read row exceeds ``1/λ``).
* ``t(n)`` is the whole path of a batch, not the model alone: the time from when the loop
  could start on it (the previous answer sent, or its last row read) to its answers sent,
  so reading, decoding, splitting and answering count as they do for the clients.
* Past capacity, a batch of ``n`` rows is answered ``t(n)`` plus a reserve for the path
  outside the inference process from now (:meth:`AdaptivePolicy.shed_horizon_s`): what
  the requests' API process reports that path costs (``params[envelope.PATH]``), at least
  ``shed_floor × latency_target``; until one reports, ``shed_reserve × latency_target``.
  The inference loop runs the largest batch whose rows all make it, and answers at once
  with a deadline error the waiting requests that batch cannot answer in time
  (batching/shedding.py), instead of running them late: the device spends itself on
  requests that can still make it, and goodput stays near capacity.
* ``max_batch_size`` and the learned ``row_cap`` bound every batch; with
  ``preferred_batch_sizes`` a ready preferred size goes unless the next one can still be
  reached in time.

Why a batch went (``Decision.reason``): ``full`` (the cap), ``window`` (``max_queue_delay_us``
reached, or it would be before another row comes), ``deadline`` (waiting would break the
latency target or a deadline) or ``policy`` (waiting would not pay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batching.policy import Decision, effective_cap, preferred_take

PATH_SMOOTHING = 0.1
"""Weight of the newest report of the path outside the inference process."""


@dataclass(slots=True)
class LatencyModel:
    """``t(n) = a + b·n`` in seconds, by exponentially weighted least squares.

    The first ``skip`` batches (warm-up, lazy initialisation) are ignored; a later sample
    far above the prediction (a pause, a page fault storm) is clipped so one outlier cannot
    drag the fit. With a single batch size seen so far the slope stays 0 and ``a`` is the
    mean time: exactly what a decision at that size needs.
    """

    forget: float = 0.97
    skip: int = 2
    samples: int = 0
    a: float = 0.0
    b: float = 0.0
    _seen: int = 0
    _s0: float = 0.0
    _s1: float = 0.0
    _s2: float = 0.0
    _sy: float = 0.0
    _sny: float = 0.0

    def predict(self, rows: float) -> float:
        return self.a + self.b * rows

    def observe(self, rows: int, seconds: float) -> None:
        self._seen += 1
        if self._seen <= self.skip or rows <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        if self.samples >= 8:
            seconds = min(seconds, 4.0 * self.predict(rows) + 0.001)
        g = self.forget
        self._s0 = g * self._s0 + 1.0
        self._s1 = g * self._s1 + rows
        self._s2 = g * self._s2 + rows * rows
        self._sy = g * self._sy + seconds
        self._sny = g * self._sny + rows * seconds
        self.samples += 1
        self._solve()

    def _solve(self) -> None:
        mean_n = self._s1 / self._s0
        mean_y = self._sy / self._s0
        var_n = self._s2 / self._s0 - mean_n * mean_n
        cov = self._sny / self._s0 - mean_n * mean_y
        # A tiny ridge on the slope: one batch size only gives b = 0, a = the mean.
        b = cov / (var_n + 1e-3) if var_n > 1e-9 else 0.0
        a = mean_y - b * mean_n
        if b < 0.0:
            a, b = mean_y, 0.0
        elif a < 0.0:
            a, b = 0.0, self._sny / self._s2
        self.a, self.b = a, b


@dataclass(slots=True)
class ArrivalRate:
    """Rows per second: a count decayed with time constant ``tau_s``.

    Rows read in a clump (everything that queued while a batch ran) count at the time they
    were read; decaying over time rather than per event keeps such clumps from skewing it.
    A gap since the last read longer than ``1/λ`` is evidence too: the estimate is then
    ``1/gap``, so a wait for arrivals that stopped ends within about one batch overhead.
    """

    tau_s: float = 0.1
    _mass: float = 0.0
    _updated: float = 0.0
    _start: float | None = None
    last: float = 0.0
    """When rows were last read."""

    def observe(self, count: int, now: float) -> None:
        if count <= 0:
            return
        if self._start is None:
            self._start = self._updated = now
        self._mass = self._decayed(now) + count
        self._updated = max(self._updated, now)
        self.last = max(self.last, now)

    def rate(self, now: float) -> float:
        if self._start is None:
            return 0.0
        # Bias-corrected while young; never over less than a quarter of tau (biased low, safe).
        elapsed = max(now - self._start, self.tau_s / 4)
        est = self._decayed(now) / (self.tau_s * -math.expm1(-elapsed / self.tau_s))
        gap = now - self.last
        if gap * est > 1.0:
            est = 1.0 / gap
        return est

    def _decayed(self, now: float) -> float:
        return self._mass * math.exp(-max(0.0, now - self._updated) / self.tau_s)


@dataclass(slots=True)
class AdaptivePolicy:
    """Dispatch at once unless a bigger batch is needed to keep up and there is time for it."""

    max_rows: int
    max_delay_s: float = 0.0
    """``max_queue_delay_us``: the longest any wait may last; 0 never waits."""
    latency_target_s: float = 0.05
    preferred: tuple[int, ...] = ()
    row_cap: int | None = None
    slack: float = 0.8
    """Share of the latency target a wait may plan to use (the rest is for error)."""
    shortfall: float = 1.5
    """Wait only while even one more row would leave the batch under ``n*/shortfall``."""
    read_lag_s: float = 0.002
    """Rows read this soon after a batch may have queued all through it."""
    trusted_after: int = 8
    """Batches the latency fit must have seen before it decides that a request is late."""
    shed_reserve: float = 0.3
    """Share of the latency target kept, when shedding, for the path outside the inference
    process (the API's admission before, the reply and the network after) while no API has
    said what it costs: a request the device answers just before its deadline reaches its
    client after it."""
    shed_floor: float = 0.05
    """Share of the latency target kept at least, once an API has said what that path
    costs: for the error of the fit."""
    path_s: float | None = None
    """What the requests' API processes report that path costs, smoothed; None until one
    does."""
    latency: LatencyModel = field(default_factory=LatencyModel)
    arrivals: ArrivalRate = field(default_factory=ArrivalRate)
    _last_end: float = -math.inf
    _last_seconds: float = 0.0
    _clock: float = 0.0

    def decide(self, now: float, rows: int, first_seen: float, earliest_deadline: float) -> Decision:
        self._clock = max(self._clock, now)
        cap = effective_cap(self.max_rows, self.row_cap)
        limit = cap if cap < self.max_rows else None
        if rows >= cap:
            return Decision(True, reason="full", max_rows=limit)
        ready = preferred_take(rows, cap, self.preferred)
        take = ready if ready is not None else limit
        closes = first_seen + self.max_delay_s
        if now >= closes:
            return Decision(True, reason="window", max_rows=take)
        lam = self.arrivals.rate(now)
        goal = self.goal_rows(lam, cap)
        if goal < self.shortfall * (rows + 1) or goal >= cap:
            return Decision(True, reason="policy", max_rows=take)
        a, b = self.latency.a, self.latency.b
        # The oldest request may have queued through the previous batch before it was read.
        age = now - first_seen + self._hidden_wait(first_seen)
        budget = min(self.slack * self.latency_target_s - age, earliest_deadline - now)
        # Rows g reachable in time: (g - rows)/λ of waiting plus t(g) must fit the budget.
        by_time = (budget - a + rows / lam) / (1.0 / lam + b)
        by_window = rows + lam * (closes - now)
        if by_time < rows + 1:
            return Decision(True, reason="deadline", max_rows=take)
        if by_window < rows + 1:
            return Decision(True, reason="window", max_rows=take)
        reach = min(by_time, by_window, float(cap))
        aim = min(goal, reach)
        if self.preferred:
            nxt = min((p for p in self.preferred if rows < p <= cap), default=None)
            if nxt is not None and nxt <= reach:
                aim = float(nxt)
            elif ready is not None:
                return Decision(True, reason="full", max_rows=ready)
        wait_s = min(max(aim - rows, 1.0) / lam, closes - now)
        return Decision(False, wait_s=wait_s)

    def goal_rows(self, lam: float, cap: int) -> float:
        """``n*``: the smallest batch whose throughput keeps up with ``lam`` rows/s."""
        if lam <= 0.0:
            return 0.0
        a, b = self.latency.a, self.latency.b
        if lam * b >= 1.0:
            return float(cap)
        return min(float(cap), lam * a / (1.0 - lam * b))

    def observe_batch(self, rows: int, seconds: float, now: float) -> None:
        self._clock = max(self._clock, now)
        self.latency.observe(rows, seconds)
        self._last_end = now
        self._last_seconds = seconds

    def observe_arrivals(self, count: int, now: float) -> None:
        self._clock = max(self._clock, now)
        self.arrivals.observe(count, now)

    def observe_path(self, seconds: float) -> None:
        was = self.path_s
        self.path_s = seconds if was is None else was + PATH_SMOOTHING * (seconds - was)

    def estimates(self) -> dict[str, float]:
        return {
            "arrival_rate_per_s": self.arrivals.rate(self._clock),
            "latency_a_s": self.latency.a,
            "latency_b_s_per_row": self.latency.b,
            "row_cap": float(effective_cap(self.max_rows, self.row_cap)),
            "shed_reserve_s": self.shed_reserve_s(),
        }

    def shed_horizon_s(self, rows: int) -> float:
        """``t(rows)`` plus the reserve for the path outside, once the fit has seen enough
        batches to trust (else 0: shed nothing), for at most the rows a batch may hold."""
        if self.latency.samples < self.trusted_after:
            return 0.0
        rows = min(rows, effective_cap(self.max_rows, self.row_cap))
        return self.latency.predict(max(1, rows)) + self.shed_reserve_s()

    def shed_reserve_s(self) -> float:
        """The time kept, when shedding, for the path outside the inference process."""
        if self.path_s is None:
            return self.shed_reserve * self.latency_target_s
        return max(self.path_s, self.shed_floor * self.latency_target_s)

    def _hidden_wait(self, first_seen: float) -> float:
        if abs(first_seen - self._last_end) <= self.read_lag_s:
            return self._last_seconds
        return 0.0
