"""When to dispatch a batch. Pure: time is passed in, nothing is read from a clock here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Decision:
    dispatch: bool
    wait_s: float = 0.0
    """When not dispatching: how long to wait locally before looking again."""
    reason: str = ""
    """Why a batch was dispatched: full, window, deadline or policy."""
    max_rows: int | None = None
    """When dispatching: take at most this many rows (None: as many as the former allows)."""


class Policy(Protocol):
    """A policy's own ``max_rows`` is the configured ``max_batch_size`` and never changes;
    a lower bound set at run time reaches it through ``row_cap``, which the inference loop's
    row cap (the one owner of the bound) publishes."""

    row_cap: int | None
    """Largest batch this instance may run (learned from out-of-memory errors, never above
    the run-time batch size bound); None: no cap."""

    def decide(self, now: float, rows: int, first_seen: float, earliest_deadline: float) -> Decision:
        """``rows`` waiting in the head shape group; ``first_seen``: when its oldest was read."""
        ...

    def observe_batch(self, rows: int, seconds: float, now: float) -> None:
        """A batch of ``rows`` took ``seconds`` of service and finished at ``now``."""
        ...

    def observe_arrivals(self, count: int, now: float) -> None:
        """``count`` rows were read from the streams at ``now``."""
        ...

    def observe_path(self, seconds: float) -> None:
        """Requests' API reported that they spend about ``seconds`` outside the inference
        process (``params[envelope.PATH]``)."""
        ...

    def estimates(self) -> dict[str, float]:
        """The policy's current estimates, for metrics (empty when it keeps none)."""
        ...

    def shed_horizon_s(self, rows: int) -> float:
        """How long a batch of ``rows`` started now would take to be answered, when the
        policy knows: past capacity, an entry that no such batch answers before its deadline
        is answered at once with an error instead of run late (batching/shedding.py). 0:
        only entries whose deadline has already passed are (Triton's rule)."""
        ...


class TunablePolicy(Policy, Protocol):
    """A policy whose window the inference loop may change at run time (Celery's
    ``conveyor_set_batching``): the ones :func:`batching.policy_choice.make_policy` builds."""

    max_delay_s: float
    """``max_queue_delay_us`` in seconds: the longest a batch waits for more rows."""


def effective_cap(max_rows: int, row_cap: int | None) -> int:
    """The most rows one batch may hold: ``max_rows``, lowered by a learned cap, never below 1."""
    if row_cap is None:
        return max_rows
    return max(1, min(max_rows, row_cap))


def preferred_take(rows: int, cap: int, preferred: tuple[int, ...]) -> int | None:
    """Triton's rule: the largest preferred size that is ready, else None (take what waits)."""
    ready = [p for p in preferred if p <= min(rows, cap)]
    return max(ready) if ready else None


@dataclass(slots=True)
class FixedWindow:
    """Triton's dynamic batcher: dispatch when full, or ``max_delay_s`` after the first entry.

    With ``max_delay_s == 0`` whatever is waiting goes at once: batches still grow under
    load, because requests pile up while the model runs. As in Triton, once a preferred
    batch size can be formed the largest such batch goes at once; ``row_cap``, when set,
    lowers the batch size bound.
    """

    max_rows: int
    max_delay_s: float = 0.0
    preferred: tuple[int, ...] = ()
    row_cap: int | None = None

    def decide(self, now: float, rows: int, first_seen: float, earliest_deadline: float) -> Decision:
        cap = effective_cap(self.max_rows, self.row_cap)
        limit = cap if cap < self.max_rows else None
        if rows >= cap:
            return Decision(True, reason="full", max_rows=limit)
        preferred = preferred_take(rows, cap, self.preferred)
        if preferred is not None:
            return Decision(True, reason="full", max_rows=preferred)
        closes = first_seen + self.max_delay_s
        if now >= closes:
            return Decision(True, reason="window", max_rows=limit)
        if earliest_deadline <= closes:
            return Decision(True, reason="deadline", max_rows=limit)
        return Decision(False, wait_s=closes - now)

    def observe_batch(self, rows: int, seconds: float, now: float) -> None:
        """A fixed window learns nothing."""

    def observe_arrivals(self, count: int, now: float) -> None:
        """A fixed window learns nothing."""

    def observe_path(self, seconds: float) -> None:
        """A fixed window learns nothing."""

    def estimates(self) -> dict[str, float]:
        return {}

    def shed_horizon_s(self, rows: int) -> float:
        """As in Triton, a request runs unless its deadline has already passed."""
        return 0.0

