"""How late this process's event loop runs: the time a request waits before the API sees it.

When the API's event loop is behind (its process short of CPU, or handling more than it
can), a request that arrives waits in the socket until the loop comes round to read it, and
its answer waits again before it is written. Neither wait is visible to the request itself,
nor to the inference process that runs it, yet the client's deadline runs through both.

:class:`LoopLag` measures that wait the way it arises: a timer due every ``period_s``, and
how late it fires. The lateness, smoothed over about ``tau_s``, estimates both waits; the
API takes twice it off the deadline it hands the inference process (:meth:`reserve_ms`), so
that past capacity a request whose answer could only reach its client late is answered at
once instead of run.
"""

from __future__ import annotations

import asyncio
import math

PERIOD_S = 0.005
TAU_S = 0.25


class LoopLag:
    """The smoothed lateness of a periodic timer on the running event loop."""

    def __init__(self, period_s: float = PERIOD_S, tau_s: float = TAU_S) -> None:
        self.period_s = period_s
        self.tau_s = tau_s
        self.seconds = 0.0
        """The smoothed lateness."""
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        """Start measuring on the running loop (once; a second call does nothing)."""
        if self._handle is None:
            self._arm(asyncio.get_running_loop())

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def observe(self, late_s: float, interval_s: float) -> None:
        """One timer's lateness ``late_s``, ``interval_s`` after the previous one's."""
        weight = -math.expm1(-max(interval_s, 0.0) / self.tau_s)
        self.seconds += weight * (max(late_s, 0.0) - self.seconds)

    def reserve_ms(self, timeout_ms: float) -> int:
        """What to take off a request's deadline for the two waits outside the inference
        process (before the API reads it, after its answer comes back): twice the lag, at
        most half of ``timeout_ms``."""
        return int(min(2.0 * self.seconds * 1000.0, timeout_ms / 2.0))

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = loop.time() + self.period_s
        self._handle = loop.call_at(self._due, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        late = loop.time() - self._due
        self.observe(late, self.period_s + max(0.0, late))
        self._arm(loop)
