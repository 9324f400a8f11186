"""Exponential back-off: the one rule behind every retry loop in conveyor.

A delay starts small, doubles after each failure up to a ceiling, and returns to the
start after a success. Loops that retry Redis, restart a crashed inference process, or
re-send a job chunk the queue refused all wait this way; they differ only in their
start and ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def nth_delay(start_s: float, max_s: float, failures: int) -> float:
    """The delay after ``failures`` earlier failures (0: the first retry waits ``start_s``)."""
    return min(start_s * 2.0 ** min(failures, 64), max_s)


@dataclass(slots=True)
class Backoff:
    """Doubling delays from ``start_s`` up to ``max_s``, back to ``start_s`` on :meth:`reset`."""

    start_s: float
    max_s: float
    delay_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.delay_s = self.start_s

    def next(self) -> float:
        """The delay to wait now; the following one doubles."""
        delay = self.delay_s
        self.delay_s = min(delay * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self.delay_s = self.start_s
