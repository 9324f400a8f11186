"""Since when the bytes read now can have waited: the event loop's turns, told by a tick.

Past what the API process can serve, requests wait unread in its sockets while the loop
works through its turn: a turn runs the callbacks that were ready at its start (request
tasks, replies), then polls the sockets and reads every one that has bytes. Bytes read in
a turn's poll arrived after the previous turn's poll returned (the sockets are polled
level-triggered, and every one ready is read), so after anything that ran before that
poll. The clock marks the turns with a callback (``call_soon``: it runs among the ready
callbacks at the start of the next turn, uvloop's and asyncio's alike) scheduled by the
first read of a turn: a read knows the time of the tick of the turn before its own, which
bounds its bytes' arrival from below. Their wait is at most the time since then, and past
capacity, when a turn takes longer than a latency target, about that long.

The tick goes on for ``ROUNDS`` turns after the last read, and stops: an idle process is
not woken for nothing. A read in a turn whose previous turn had no tick (the loop was
idle, or a chain of ticks had just begun) has no bound: ``None``; past capacity every turn
reads, and the chain never breaks.
"""

from __future__ import annotations

import asyncio
import time

ROUNDS = 2
"""Turns the tick goes on for after the last read."""


class TurnClock:
    """Per event loop. :meth:`read` from every read of a socket."""

    __slots__ = (
        "_before",
        "_bound",
        "_chained",
        "_last",
        "_left",
        "_loop",
        "_pending",
        "_read",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending = False
        """A tick is scheduled: it runs at the start of the next turn."""
        self._left = 0
        """Ticks still to come after the scheduled one, unless a read comes."""
        self._last = 0.0
        """When the latest tick ran (``time.perf_counter()``)."""
        self._before: float | None = None
        """When the tick of the turn before the latest tick's ran, when there was one."""
        self._chained = False
        """The scheduled tick was scheduled by a tick: they run in adjacent turns."""
        self._read = False
        """A read came since the latest tick: it was in the latest tick's turn."""
        self._bound: float | None = None
        """The bound of the reads of the current turn."""

    def read(self) -> float | None:
        """The ``time.perf_counter()`` after which bytes read now arrived, or None when
        the loop's previous turn is not known."""
        if self._read:  # not the first read of this turn: the same bound
            return self._bound
        self._read = True
        self._left = ROUNDS
        if self._pending:  # scheduled by a tick of this turn: it ran before this poll
            self._bound = self._before
        else:  # the loop had no tick this turn: its previous turn is not known
            self._bound = None
            self._pending = True
            self._chained = False
            self._loop.call_soon(self._tick)
        return self._bound

    def _tick(self) -> None:
        now = time.perf_counter()
        self._before = self._last if self._chained else None
        self._last = now
        self._read = False
        if self._left > 0:
            self._left -= 1
            self._chained = True
            self._loop.call_soon(self._tick)
        else:
            self._pending = False
