"""The learned memory cap of one inference process: what its device can hold.

The cap bounds a batch's *cost*: its rows, or for a model with a padded axis its rows times
the padded length (the longest request's along that axis), the size of the tensors the
model is given. So long and short requests share one learned limit: a cap of 256 lets 32
rows of length 8 run together, or 4 rows of length 64.

Out of memory at cost c (c within the cap) halves the cap (multiplicative decrease) and
remembers c - 1 as the ceiling; a run of full batches at the cap (one more row would not
have fitted) raises it by one row (additive probe), up to the ceiling. Memory use can change
(fragmentation, other models on the device), so the ceiling itself rises by one row after a
long run of full batches at it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_AFTER = 8
"""Full batches at the cap before trying one row more."""
RELAX_AFTER = 256
"""Full batches at the ceiling before trying one row above it."""
UNBOUNDED = 2**62
"""The limit of a cap that only out-of-memory errors set: no bound before the first one."""


@dataclass(slots=True)
class RowCap:
    """A cap on the cost of a batch, learned from out-of-memory errors, never above
    ``limit``. With a cost of one per row (the default unit) it is a cap on rows."""

    limit: int
    cap: int = field(default=0)
    ceiling: int = field(default=0)
    _full_batches: int = 0

    def __post_init__(self) -> None:
        self.cap = self.cap or self.limit
        self.ceiling = self.ceiling or self.limit

    def on_oom(self, cost: int) -> None:
        """A batch of ``cost`` did not fit. A batch costlier than the cap (formed before the
        cap fell, or the other half of one being bisected) says nothing new about the cap."""
        self.ceiling = max(1, min(self.ceiling, cost - 1))
        if cost <= self.cap:
            self.cap = max(1, cost // 2)
        self._full_batches = 0

    def on_success(self, cost: int, unit: int = 1) -> None:
        """A batch of ``cost`` fitted; ``unit`` is what one more of its rows would cost.
        It was full when that row would not have fitted the cap."""
        if cost + unit <= self.cap or self.cap >= self.limit:
            return
        self._full_batches += 1
        if self.cap < self.ceiling and self._full_batches >= PROBE_AFTER:
            self.cap = min(self.ceiling, self.cap + unit)
            self._full_batches = 0
        elif self._full_batches >= RELAX_AFTER:
            self.ceiling = self.cap = min(self.limit, self.cap + unit)
            self._full_batches = 0
