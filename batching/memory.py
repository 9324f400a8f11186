"""The learned row cap of one inference process: what its device can hold.

Out of memory at n rows (n within the cap) halves the cap (multiplicative decrease) and
remembers n - 1 as the ceiling; a run of full batches at the cap raises it by one row (additive probe), up
to the ceiling. Memory use can change (fragmentation, other models on the device), so the
ceiling itself rises by one after a long run of full batches at it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_AFTER = 8
"""Full batches at the cap before trying one row more."""
RELAX_AFTER = 256
"""Full batches at the ceiling before trying one row above it."""


@dataclass(slots=True)
class RowCap:
    limit: int
    cap: int = field(default=0)
    ceiling: int = field(default=0)
    _full_batches: int = 0

    def __post_init__(self) -> None:
        self.cap = self.cap or self.limit
        self.ceiling = self.ceiling or self.limit

    def on_oom(self, rows: int) -> None:
        """``rows`` did not fit. A batch larger than the cap (formed before the cap fell,
        or the other half of one being bisected) says nothing new about the cap."""
        self.ceiling = max(1, min(self.ceiling, rows - 1))
        if rows <= self.cap:
            self.cap = max(1, rows // 2)
        self._full_batches = 0

    def on_success(self, rows: int) -> None:
        if rows < self.cap or self.cap >= self.limit:
            return
        self._full_batches += 1
        if self.cap < self.ceiling and self._full_batches >= PROBE_AFTER:
            self.cap += 1
            self._full_batches = 0
        elif self._full_batches >= RELAX_AFTER:
            self.ceiling = self.cap = min(self.limit, self.cap + 1)
            self._full_batches = 0
