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
    """Why a batch was dispatched: full, window or deadline."""


class Policy(Protocol):
    def decide(self, now: float, rows: int, first_seen: float, earliest_deadline: float) -> Decision:
        """``rows`` waiting in the head shape group; ``first_seen``: when its oldest was read."""
        ...


@dataclass(slots=True)
class FixedWindow:
    """Triton's dynamic batcher: dispatch when full, or ``max_delay_s`` after the first entry.

    With ``max_delay_s == 0`` whatever is waiting goes at once: batches still grow under
    load, because requests pile up while the model runs.
    """

    max_rows: int
    max_delay_s: float = 0.0

    def decide(self, now: float, rows: int, first_seen: float, earliest_deadline: float) -> Decision:
        if rows >= self.max_rows:
            return Decision(True, reason="full")
        closes = first_seen + self.max_delay_s
        if now >= closes:
            return Decision(True, reason="window")
        if earliest_deadline <= closes:
            return Decision(True, reason="deadline")
        return Decision(False, wait_s=closes - now)
