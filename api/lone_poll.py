"""The API's event loop kept polling, not sleeping, while a lone request's reply is due
soon (``CONVEYOR_BUSY_POLL_US``): each turn yields the CPU to any runnable process, then
runs the loop once more. The poll starts only when the reply is nearly due (after
``POLL_LEAD`` of its model's usual run time for lone requests), so that it does not take a
core from the model while it runs. With more requests in flight the loop rarely sleeps
anyway, and polling would take CPU from their work."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

EXEC_SMOOTHING = 0.25
"""Weight of the newest lone request's run time in its model's smoothed one."""
POLL_LEAD = 0.8
"""The poll for a lone request starts after this share of its model's usual run time."""


class LonePoll:
    """``waiting()``: how many requests await their replies."""

    def __init__(self, busy_poll_s: float, waiting: Callable[[], int]) -> None:
        self._busy_poll_s = busy_poll_s
        self._waiting = waiting
        self._until = 0.0
        self._polling = False
        self._start: asyncio.TimerHandle | None = None
        """When the poll for the lone request in flight begins."""
        self._exec_s: dict[str, float] = {}
        """Per model (its rows key): the model's run time for lone requests, smoothed."""

    @property
    def polling(self) -> bool:
        return self._polling

    def submitted(self, model: str, lone: bool) -> None:
        """A request to ``model`` submitted (``lone``: the only one in flight)."""
        lead = self._exec_s.get(model, 0.0) * POLL_LEAD
        self._until = time.perf_counter() + lead + self._busy_poll_s
        if lone and self._busy_poll_s > 0:
            if self._start is not None:  # an earlier lone request's, not yet begun
                self._start.cancel()
            self._start = asyncio.get_running_loop().call_later(lead, self._begin)

    def replied(self) -> None:
        """Replies arrived: poll a while longer for the next."""
        self._until = time.perf_counter() + self._busy_poll_s

    def note_exec(self, model: str, seconds: float) -> None:
        """A lone request to ``model`` took ``seconds`` in the model."""
        seen = self._exec_s.get(model)
        self._exec_s[model] = seconds if seen is None else seen + EXEC_SMOOTHING * (seconds - seen)

    def close(self) -> None:
        if self._start is not None:
            self._start.cancel()

    def _begin(self) -> None:
        self._start = None
        if not self._polling:
            self._polling = True
            self._poll()

    def _poll(self) -> None:
        if self._waiting() == 1 and time.perf_counter() < self._until:
            os.sched_yield()
            asyncio.get_running_loop().call_soon(self._poll)
        else:
            self._polling = False
