"""One model instance as the supervisor keeps it: its process, its restart history, and
whether it belongs to the version that serves or to a reload being staged beside it."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from batching.backoff import Backoff
from workers.shared_state import ProcState, SharedState

log = logging.getLogger("conveyor.supervisor")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0


@dataclass(slots=True)
class Slot:
    """One model instance: the process now serving it and its restart history."""

    model: str
    device: str
    index: int
    execution_timeout_s: float
    override: dict[str, Any] | None = None
    """The configuration a repository load gave, which its process runs (None: the
    folder's)."""
    staged: bool = False
    """Started by a reload beside the slots that serve: it replaces them once every staged
    slot of the model is ready, and is abandoned if one fails."""
    generation: int = 0
    """Which reload made it (0: the model's first load), so its name differs from the
    slots it replaces."""
    process: BaseProcess | None = None
    shared: SharedState | None = None
    started: float = 0.0
    kill_at: float = 0.0
    restarts: int = 0
    load_failures: int = 0
    backoff: Backoff = field(default_factory=lambda: Backoff(BACKOFF_START_S, BACKOFF_MAX_S))
    next_start: float = 0.0
    failed: bool = False
    failed_at: float = 0.0
    """Epoch seconds when the slot was marked failed."""
    reason: str = ""
    """Why it failed, published in its heartbeat."""
    failure: Any = None
    """The shared buffer its process writes a load failure into."""
    retired: bool = False

    @property
    def ready(self) -> bool:
        return (self.process is not None and self.process.is_alive() and not self.kill_at
                and self.shared is not None and self.shared.state == ProcState.READY)

    @property
    def state(self) -> str:
        """``failed``, ``restarting`` or ``starting`` (no process now), ``stopping`` (being
        killed or draining), ``loading`` or ``ready``."""
        if self.failed:
            return "failed"
        if self.process is None or not self.process.is_alive() or self.shared is None:
            return "restarting" if self.restarts else "starting"
        if self.kill_at or self.shared.state == ProcState.STOPPING:
            return "stopping"
        return "ready" if self.shared.state == ProcState.READY else "loading"

    @property
    def name(self) -> str:
        index = f"{self.index}.{self.generation}" if self.generation else str(self.index)
        return f"{socket.gethostname()}:{os.getpid()}:{self.model}:{self.device}:{index}:slot"


def retry_failed(slots: list[Slot]) -> None:
    """A new load of a model whose slots failed starts them again now."""
    for slot in slots:
        if slot.failed and slot.process is None and not slot.retired:
            slot.failed, slot.reason, slot.load_failures = False, "", 0
            slot.next_start = 0.0
            slot.backoff.reset()
            log.info("retrying %s on %s after a new load", slot.model, slot.device)
