"""Forming batches from stream entries: the in-memory state of one inference process.

The former owns the entries this process has read but not yet run. It orders them by
priority and, within a priority, earliest deadline first (a request's deadline is its
``parameters.timeout``, or the model's ``queue.default_timeout_ms``, after it was
enqueued); it answers none of them itself (it hands expired ones back to the caller), and
gives out one shape group at a time, in that order, as the policy decides.

Priority aging (``queue.max_priority_wait_ms``): an entry of a level below 1 that has
waited that long since the API enqueued it is *aged*: it goes ahead of every level, aged
entries oldest first. Without it priority is strict, and a busy level 1 starves the others.

With a latency target (the adaptive policy), an entry is scheduled against the sooner of
its deadline and the target after it was enqueued (:meth:`BatchFormer.due`). Past capacity
(:meth:`BatchFormer.overload`, set by workers/expiry.py) with ``lifo``, the newest entry of
a level goes first: the oldest are the ones that will miss the target anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from batching.config import ModelConfig
from batching.contiguous import adjacent
from batching.envelope import VERSION, Request, split_rows
from batching.policy import Decision, Policy
from batching.shedding import rows_in_time


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
    aged: bool = False
    """Waited ``max_priority_wait_ms``: served ahead of every priority level."""

    @property
    def rows(self) -> int:
        return self.request.rows

    @property
    def deadline(self) -> float:
        return self.request.deadline_ms / 1000.0

    @property
    def cost(self) -> float:
        return float(self.request.params.get("cost", self.rows))


ShapeKey = tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]
"""The model version asked for, and each input's name and dims."""
Staging = Callable[[str, tuple[int, ...], "np.dtype[Any]"], "npt.NDArray[Any] | None"]
"""Where a batch's input of this name, shape and dtype may be stacked (a model's pinned
host buffer), or None: a new array."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Which axes may differ between requests of one batch (padded), from the config."""

    pad: dict[str, tuple[int, float]] = field(default_factory=dict)
    """input name -> (axis, pad value)"""
    unpad: dict[str, int] = field(default_factory=dict)
    """output name -> the axis to cut back to each request's own length"""

    @classmethod
    def of(cls, config: ModelConfig) -> Layout:
        return cls({t.name: (t.pad_axis, t.pad_value) for t in config.inputs
                    if t.pad_axis is not None},
                   {t.name: t.pad_axis for t in config.outputs if t.pad_axis is not None})

    def key(self, request: Request) -> ShapeKey:
        """Requests stack together only when this agrees: the model version, and every
        dim but padded axes."""
        parts = []
        for tensor in request.inputs:
            dims = list(tensor.shape[1:])
            if tensor.name in self.pad:
                dims[self.pad[tensor.name][0] - 1] = -1
            parts.append((tensor.name, tuple(dims)))
        return str(request.params.get(VERSION, "")), tuple(parts)

    def length(self, request: Request) -> int | None:
        """The request's own length along the first padded input's axis."""
        for tensor in request.inputs:
            if tensor.name in self.pad:
                return tensor.shape[self.pad[tensor.name][0]]
        return None

    def width(self, request: Request) -> int:
        """What one of the request's rows weighs in a batch's memory cost: its padded
        length (at least 1), or 1 without a padded axis."""
        return max(1, self.length(request) or 1) if self.pad else 1


@dataclass(slots=True)
class Batch:
    entries: list[Entry]
    reason: str
    layout: Layout = field(default_factory=Layout)

    @property
    def rows(self) -> int:
        return sum(e.rows for e in self.entries)

    @property
    def width(self) -> int:
        """The padded length every row of the batch is given (1 without a padded axis)."""
        return max(self.layout.width(e.request) for e in self.entries)

    @property
    def lone(self) -> bool:
        """One request, sent while its API process had no other in flight
        (``params["lone"]``): the load is light, and the next wait may busy-poll."""
        return len(self.entries) == 1 and bool(self.entries[0].request.params.get("lone"))

    def stacked_inputs(self, staging: Staging | None = None) -> dict[str, npt.NDArray[Any]]:
        """Concatenate each input along the batch axis, in entry order, padding declared
        variable axes to the longest in the batch; into the array ``staging`` gives for
        the input's name, shape and dtype where it gives one (a model's pinned buffer).
        Without either, rows that already lie in order in one buffer (fetched together)
        are that buffer's bytes, uncopied (batching/contiguous.py)."""
        first = self.entries[0].request.inputs
        if len(self.entries) == 1:
            return {t.name: t.array() for t in first}
        stacked = {}
        for i, tensor in enumerate(first):
            parts = [e.request.inputs[i].array() for e in self.entries]
            if tensor.name in self.layout.pad:
                parts = _pad_to_longest(parts, *self.layout.pad[tensor.name])
            elif staging is None:
                joined = adjacent(parts, [e.request.inputs[i].raw for e in self.entries])
                if joined is not None:  # fetched together: already one array
                    stacked[tensor.name] = joined
                    continue
            out = None
            if staging is not None and len({p.dtype for p in parts}) == 1:
                shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
                out = staging(tensor.name, shape, parts[0].dtype)
            stacked[tensor.name] = np.concatenate(parts, out=out)
        return stacked

    def split(self, outputs: dict[str, npt.NDArray[Any]]) -> list[dict[str, npt.NDArray[Any]]]:
        """Per entry, its own rows of every output, cut back to its own padded length."""
        counts = [e.rows for e in self.entries]
        per_output = {name: split_rows(arr, counts) for name, arr in outputs.items()}
        result = []
        for i, entry in enumerate(self.entries):
            own = {name: parts[i] for name, parts in per_output.items()}
            length = self.layout.length(entry.request)
            for name, axis in self.layout.unpad.items():
                if name in own and length is not None:
                    own[name] = np.take(own[name], np.arange(length), axis=axis)
            result.append(own)
        return result


def _pad_to_longest(parts: list[npt.NDArray[Any]], axis: int,
                    value: float) -> list[npt.NDArray[Any]]:
    longest = max(p.shape[axis] for p in parts)
    padded = []
    for part in parts:
        missing = longest - part.shape[axis]
        if missing:
            widths = [(0, 0)] * part.ndim
            widths[axis] = (0, missing)
            part = np.pad(part, widths, constant_values=value)
        padded.append(part)
    return padded


def _deadline(entry: Entry) -> float:
    return entry.deadline


@dataclass(slots=True)
class BatchFormer:
    policy: Policy
    max_rows: int
    """The configured ``max_batch_size``; the inference loop passes a lower run-time bound
    to :meth:`take`."""
    layout: Layout = field(default_factory=Layout)
    max_cost: float | None = None
    """Bound on the summed ``cost`` parameter of a batch's requests (a request's cost
    defaults to its rows)."""
    max_wait_ms: int | None = None
    """``queue.max_priority_wait_ms``: priority aging; None: strict priority."""
    max_padded: int | None = None
    """The learned memory cap of a model with a padded axis (batching/memory.py): rows
    times the padded length, at most; None: no such cap yet."""
    target_s: float | None = None
    """The latency target entries are scheduled against (:meth:`due`); None: their own
    deadlines only (a fixed window, as Triton)."""
    lifo: bool = False
    """While :attr:`overloaded`, newest first within a level (``batching.overload: lifo``)."""
    overloaded: bool = False
    """Past capacity: a standing queue (workers/expiry.py says when)."""
    _pending: list[Entry] = field(default_factory=list)
    _next_aging_ms: float = float("inf")
    """When the next entry not yet aged will be (ms since the epoch)."""

    @property
    def pending_rows(self) -> int:
        return sum(e.rows for e in self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def best_priority(self) -> int:
        """The most urgent priority level waiting here (0 when nothing waits)."""
        if not self._pending:
            return 0
        if self._pending[0].aged:  # aged entries lead whatever their level
            return min(e.request.prio for e in self._pending)
        return self._pending[0].request.prio

    def due(self, entry: Entry) -> float:
        """When ``entry`` should be answered by (s since the epoch): its deadline, or the
        latency target after it was enqueued when that is sooner."""
        if self.target_s is None:
            return entry.deadline
        return min(entry.deadline, entry.request.enq_ms / 1000.0 + self.target_s)

    def _order(self, entry: Entry) -> tuple[int, float]:
        """Aged entries first, oldest first; then by priority level, and within a level by
        :meth:`due` (earliest first), or, past capacity with ``lifo``, newest first.
        Python's sort is stable: ties keep the order entries were read in."""
        if entry.aged:
            return 0, entry.request.enq_ms
        if self.lifo and self.overloaded:
            return entry.request.prio, -entry.request.enq_ms
        return entry.request.prio, self.due(entry)

    def waited(self, now: float) -> float:
        """The longest any entry waiting here has waited since the API enqueued it."""
        if not self._pending:
            return 0.0
        return now - min(e.request.enq_ms for e in self._pending) / 1000.0

    def overload(self, on: bool) -> None:
        """Enter or leave the past-capacity order."""
        if on != self.overloaded:
            self.overloaded = on
            self._pending.sort(key=self._order)

    def add(self, entries: Iterable[Entry]) -> None:
        fresh = list(entries)
        self._pending.extend(fresh)
        if self.max_wait_ms is not None:
            for e in fresh:
                if e.request.prio > 1:
                    self._next_aging_ms = min(self._next_aging_ms,
                                              e.request.enq_ms + self.max_wait_ms)
        self._pending.sort(key=self._order)

    def _age(self, now: float) -> None:
        """Mark the entries that have waited ``max_wait_ms``; they move to the front."""
        now_ms = now * 1000.0
        if self.max_wait_ms is None or now_ms < self._next_aging_ms:
            return
        wait = self.max_wait_ms
        upcoming = float("inf")
        for e in self._pending:
            if e.aged or e.request.prio == 1:
                continue
            if e.request.enq_ms + wait <= now_ms:
                e.aged = True
            else:
                upcoming = min(upcoming, e.request.enq_ms + wait)
        self._next_aging_ms = upcoming
        self._pending.sort(key=self._order)

    def take_expired(self, now: float) -> list[Entry]:
        """Remove and return entries whose deadline has passed: they must never run."""
        expired = [e for e in self._pending if e.deadline <= now]
        if expired:
            self._pending = [e for e in self._pending if e.deadline > now]
        return expired

    def take_unanswerable(self, now: float, horizon: Callable[[int], float], cap: int,
                          by_target: bool = False) -> tuple[list[Entry], int, float]:
        """Past capacity: remove and return the entries that no batch started now can answer
        in time (before their deadline, or ``by_target`` before :meth:`due`), the rows the
        next batch may hold so that all of them make it (batching/shedding.py; 0 when not
        even a lone row can), and the time below which a row's own deadline cannot be met.
        ``by_target`` falls back to deadlines when not even a lone row can make the target:
        then the estimate of the path, not the queue, says so, and refusing everything
        would answer nothing in time."""
        by_deadline = rows_in_time(((e.deadline, e.rows) for e in self._pending), now,
                                   horizon, cap)
        rows, threshold = by_deadline
        due: Callable[[Entry], float] = _deadline
        if by_target:
            rows, threshold = rows_in_time(((self.due(e), e.rows) for e in self._pending), now,
                                           horizon, cap)
            if rows:
                due = self.due
            else:
                rows, threshold = by_deadline
        late = [e for e in self._pending if due(e) < threshold]
        if late:
            self._pending = [e for e in self._pending if due(e) >= threshold]
        return late, rows, by_deadline[1]

    def _fitting(self, group: list[Entry]) -> list[Entry]:
        """The leading entries of ``group`` whose rows times their longest padded length
        stay within ``max_padded`` (the first always)."""
        if self.max_padded is None:
            return group
        rows = width = 0
        for i, entry in enumerate(group):
            rows += entry.rows
            width = max(width, self.layout.width(entry.request))
            if i and rows * width > self.max_padded:
                return group[:i]
        return group

    def take_withdrawn(self, marks: dict[str, str]) -> list[Entry]:
        """Remove and return the entries ``marks`` names (entry id -> stream): their
        clients left, they must never run."""
        gone = [e for e in self._pending if marks.get(e.entry_id) == e.stream]
        if gone:
            self._pending = [e for e in self._pending
                             if marks.get(e.entry_id) != e.stream]
        return gone

    def _head_group(self) -> list[Entry]:
        key = self.layout.key(self._pending[0].request)
        return [e for e in self._pending if self.layout.key(e.request) == key]

    def decide(self, now: float) -> Decision:
        if not self._pending:
            return Decision(False, wait_s=float("inf"))
        self._age(now)
        group = self._head_group()
        if self.max_padded is not None and len(self._fitting(group)) < len(group):
            # The memory cap, not the policy, bounds this batch: waiting cannot grow it.
            return Decision(True, reason="full")
        return self.policy.decide(
            now,
            rows=sum(e.rows for e in group),
            first_seen=min(e.seen for e in group),
            earliest_deadline=min(self.due(e) for e in group),
        )

    def take(self, reason: str, max_rows: int | None = None) -> Batch:
        """Remove the head shape group, up to ``max_rows`` rows, in the former's order.

        A re-delivered entry runs alone: if it is what killed a process, it fails alone
        and its former neighbours succeed.
        """
        limit = min(self.max_rows, max_rows or self.max_rows)
        chosen: list[Entry] = []
        rows = 0
        cost = 0.0
        for entry in self._fitting(self._head_group()):
            if chosen and (rows + entry.rows > limit or entry.deliveries > 1
                           or chosen[0].deliveries > 1
                           or (self.max_cost is not None
                               and cost + entry.cost > self.max_cost)):
                break
            chosen.append(entry)
            rows += entry.rows
            cost += entry.cost
        taken = {id(e) for e in chosen}
        self._pending = [e for e in self._pending if id(e) not in taken]
        return Batch(chosen, reason, self.layout)
