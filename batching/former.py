"""Forming batches from stream entries: the in-memory state of one inference process.

The former owns the entries this process has read but not yet run. It orders them by
priority, answers none of them itself (it hands expired ones back to the caller), and
gives out one shape group at a time, oldest first, as the policy decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from batching.envelope import Request, split_rows
from batching.policy import Decision, Policy


@dataclass(slots=True)
class Entry:
    """A request read from a stream and not yet acknowledged."""

    stream: str
    entry_id: str
    request: Request
    seen: float
    """Wall-clock seconds when this process read it."""
    deliveries: int = 1
    """How often Redis has handed it out; above 1 it outlived a process (maybe killed it)."""

    @property
    def rows(self) -> int:
        return self.request.rows

    @property
    def deadline(self) -> float:
        return self.request.deadline_ms / 1000.0


@dataclass(slots=True)
class Batch:
    entries: list[Entry]
    reason: str

    @property
    def rows(self) -> int:
        return sum(e.rows for e in self.entries)

    def stacked_inputs(self) -> dict[str, npt.NDArray[Any]]:
        """Concatenate each input along the batch axis, in entry order."""
        first = self.entries[0].request.inputs
        if len(self.entries) == 1:
            return {t.name: t.array() for t in first}
        return {
            t.name: np.concatenate([e.request.inputs[i].array() for e in self.entries])
            for i, t in enumerate(first)
        }

    def split(self, outputs: dict[str, npt.NDArray[Any]]) -> list[dict[str, npt.NDArray[Any]]]:
        """Per entry, its own rows of every output."""
        counts = [e.rows for e in self.entries]
        per_output = {name: split_rows(arr, counts) for name, arr in outputs.items()}
        return [{name: parts[i] for name, parts in per_output.items()}
                for i in range(len(self.entries))]


@dataclass(slots=True)
class BatchFormer:
    policy: Policy
    max_rows: int
    _pending: list[Entry] = field(default_factory=list)

    @property
    def pending_rows(self) -> int:
        return sum(e.rows for e in self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, entries: Iterable[Entry]) -> None:
        self._pending.extend(entries)
        # Stable: priority first, then arrival order within a priority.
        self._pending.sort(key=lambda e: e.request.prio)

    def take_expired(self, now: float) -> list[Entry]:
        """Remove and return entries whose deadline has passed: they must never run."""
        expired = [e for e in self._pending if e.deadline <= now]
        if expired:
            self._pending = [e for e in self._pending if e.deadline > now]
        return expired

    def _head_group(self) -> list[Entry]:
        key = self._pending[0].request.shape_key()
        return [e for e in self._pending if e.request.shape_key() == key]

    def decide(self, now: float) -> Decision:
        if not self._pending:
            return Decision(False, wait_s=float("inf"))
        group = self._head_group()
        return self.policy.decide(
            now,
            rows=sum(e.rows for e in group),
            first_seen=min(e.seen for e in group),
            earliest_deadline=min(e.deadline for e in group),
        )

    def take(self, reason: str, max_rows: int | None = None) -> Batch:
        """Remove the head shape group, up to ``max_rows`` rows, oldest first.

        A re-delivered entry runs alone: if it is what killed a process, it fails alone
        and its former neighbours succeed.
        """
        limit = min(self.max_rows, max_rows or self.max_rows)
        chosen: list[Entry] = []
        rows = 0
        for entry in self._head_group():
            if chosen and (rows + entry.rows > limit or entry.deliveries > 1
                           or chosen[0].deliveries > 1):
                break
            chosen.append(entry)
            rows += entry.rows
        taken = {id(e) for e in chosen}
        self._pending = [e for e in self._pending if id(e) not in taken]
        return Batch(chosen, reason)
