"""What an inference process tells its supervisor, through shared memory (no Redis needed).

The supervisor reads it to spot a hung process: a batch running past the execution
timeout, or a heartbeat that stopped (a SIGSTOPped or wedged process beats no more).
"""

from __future__ import annotations

import time
from enum import IntEnum
from multiprocessing.context import SpawnContext
from typing import Any


class ProcState(IntEnum):
    LOADING = 0
    READY = 1
    STOPPING = 2


class SharedState:
    """Four doubles: state, batch start (0 when idle), last heartbeat, learned row cap."""

    _STATE, _BUSY, _BEAT, _CAP = range(4)

    def __init__(self, ctx: SpawnContext) -> None:
        self._array: Any = ctx.Array("d", 4, lock=False)
        self.beat()

    @property
    def state(self) -> ProcState:
        return ProcState(int(self._array[self._STATE]))

    @state.setter
    def state(self, value: ProcState) -> None:
        self._array[self._STATE] = float(value)

    @property
    def busy_since(self) -> float:
        """Monotonic seconds when the running batch started; 0.0 when idle."""
        return float(self._array[self._BUSY])

    @busy_since.setter
    def busy_since(self, value: float) -> None:
        self._array[self._BUSY] = value

    @property
    def last_beat(self) -> float:
        return float(self._array[self._BEAT])

    def beat(self) -> None:
        self._array[self._BEAT] = time.monotonic()

    @property
    def row_cap(self) -> int:
        return int(self._array[self._CAP])

    @row_cap.setter
    def row_cap(self, value: int) -> None:
        self._array[self._CAP] = float(value)
