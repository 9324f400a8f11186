"""How fast an inference process serves rows while it runs batches (rows per busy second).

Measured over the last few batches (each older batch weighs ``DECAY`` as much as the one
after it), so it follows the batch sizes the current load forms. Idle time does not
count: a process that waited a minute for work still serves at the rate it showed, and
the queue drain estimate (docs/metrics.md) divides waiting rows by it.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8
"""Weight of the earlier batches against the latest: about the last ten batches count."""


@dataclass(slots=True)
class ServiceRate:
    rows: float = 0.0
    seconds: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """One executed batch of ``rows`` that ran for ``seconds``."""
        self.rows = self.rows * DECAY + rows
        self.seconds = self.seconds * DECAY + max(seconds, 0.0)

    @property
    def rows_per_s(self) -> float:
        """0 until a batch has run."""
        return self.rows / self.seconds if self.seconds > 0 else 0.0
