"""In-memory stand-ins for an inference process's Redis side, to drive the loop in tests.

In the spirit of dramatiq's ``StubBroker``: :class:`MemoryStreams`, :class:`MemoryReclaimer`
and :class:`MemoryReconciler` keep what :class:`workers.streams.ModelStreams`,
:class:`workers.recovery.Reclaimer` and :class:`workers.reconcile.RowsReconciler` keep in
Redis (the streams, the entries read and not yet answered, the reply lists, the
rows-waiting counter, the dead-letter streams, the statistics) in plain Python objects. A
test puts requests in, calls :meth:`workers.inference.InferenceLoop.step` and reads the
replies back, all in one thread, without a server.

Where Redis would wait, these do not: a blocking read of empty streams returns at once
(nobody else can write while the loop runs), answers apply at once, statistics need no
flush. Entries that a dead consumer left pending are put in with ``deliveries`` above 1;
the reclaimer hands them to the loop with its next poll. ``read_s`` and ``answer_s`` give
each read and each answer a cost (a sleep, which, like a socket, lets other threads run),
so a test can tell a loop that overlaps the Redis side with the model from one that does not.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from batching.envelope import Reply, Request
from batching.former import Entry
from workers.reconcile import RECONCILE_EVERY_S


def _no_loss(why: str) -> None:
    """The default listener for lost data: nobody is told."""


@dataclass(slots=True)
class _Stored:
    """An entry as the stream holds it: the encoded request, as in Redis."""

    stream: str
    entry_id: str
    data: bytes
    rows: int
    deliveries: int


class MemoryStreams:
    """A model's request streams, its reply lists and its counters, in memory."""

    def __init__(self, streams: list[str]) -> None:
        self.streams = streams
        self.on_data_lost: Callable[[str], None] = _no_loss
        self.rows_waiting = 0
        """The rows-waiting counter: rows put in, less the rows of answered entries."""
        self.lists: defaultdict[str, list[bytes]] = defaultdict(list)
        """Reply lists: reply key -> encoded replies, in the order they were pushed."""
        self.dead_letters: defaultdict[str, list[tuple[Entry, str]]] = defaultdict(list)
        """Dead-letter streams: key -> (entry, reason)."""
        self.stats: Counter[str] = Counter()
        """The model's statistics hash: counters and latest values."""
        self.suspect: str | None = None
        """The entry on trial (run alone after a re-delivery); cleared by the next answer."""
        self._unread: dict[str, deque[_Stored]] = {name: deque() for name in streams}
        self._pending: dict[str, _Stored] = {}
        """Entries handed out (read or claimed) and not yet answered, by entry id."""
        self._abandoned: deque[_Stored] = deque()
        """Entries a dead consumer left pending, waiting to be claimed."""
        self._ids = itertools.count(1)
        self.read_s = 0.0
        """Seconds each :meth:`read` takes."""
        self.answer_s = 0.0
        """Seconds each :meth:`answer` takes."""
        self.withdrawn: dict[str, str] = {}
        """The marks as the last :meth:`read` saw them: entry id -> stream."""
        self._marks: dict[str, str] = {}
        """The withdrawn set: entries handed out whose clients left."""

    def put(self, request: Request, deliveries: int = 1) -> str:
        """Admit ``request`` to the stream of its priority; return its entry id. With
        ``deliveries`` above 1 it is pending on a dead consumer that took it that often:
        only the reclaimer hands it out."""
        stored = _Stored(self.streams[request.prio - 1], f"{next(self._ids)}-0",
                         request.encode(), request.rows, deliveries)
        self.rows_waiting += stored.rows
        if deliveries > 1:
            self._abandoned.append(stored)
        else:
            self._unread[stored.stream].append(stored)
        return stored.entry_id

    def leave(self, entry_id: str) -> None:
        """The client of ``entry_id`` left, as batching/lua/withdraw.lua handles it: an
        unread entry is deleted and counted, a handed-out one marked for the loop."""
        if entry_id in self._pending:
            self._marks[entry_id] = self._pending[entry_id].stream
            return
        for unread in self._unread.values():
            for stored in unread:
                if stored.entry_id == entry_id:
                    unread.remove(stored)
                    self.rows_waiting -= stored.rows
                    self.stats["withdrawn_count"] += 1
                    return

    def withdraw(self, entries: list[Entry]) -> None:
        """Release entries unrun, with no reply, and count them."""
        for entry in entries:
            self._marks.pop(entry.entry_id, None)
            self.withdrawn.pop(entry.entry_id, None)
            if self._pending.pop(entry.entry_id, None) is not None:
                self.rows_waiting -= entry.rows
        self.stats["withdrawn_count"] += len(entries)

    def replies(self, key: str) -> list[Reply]:
        """Pop every reply pushed onto ``key``, decoded."""
        return [Reply.decode(blob) for blob in self.lists.pop(key, [])]

    def rows_in_streams(self) -> int:
        """The rows of every entry still in a stream: what reconciliation counts."""
        held = itertools.chain(self._pending.values(), self._abandoned,
                               *self._unread.values())
        return sum(stored.rows for stored in held)

    def read(self, count: int, block_ms: int | None, levels: int | None = None,
             poll: bool = False) -> list[Entry]:
        """Up to ``count`` new entries of each stream of the top ``levels`` (None: all),
        highest priority first; never waits (but takes ``read_s``)."""
        time.sleep(self.read_s)
        self.withdrawn = dict(self._marks)
        entries = []
        for name in self.streams[:levels]:
            unread = self._unread[name]
            for _ in range(min(count, len(unread))):
                entries.append(self._hand_out(unread.popleft()))
        return entries

    def claim(self, count: int) -> list[Entry]:
        """Take over up to ``count`` abandoned entries, oldest first."""
        return [self._hand_out(self._abandoned.popleft())
                for _ in range(min(count, len(self._abandoned)))]

    def _hand_out(self, stored: _Stored) -> Entry:
        self._pending[stored.entry_id] = stored
        return Entry(stored.stream, stored.entry_id, Request.decode(stored.data), time.time(),
                     stored.deliveries)

    def answer(self, answered: Iterable[tuple[Entry, Reply]],
               counters: Mapping[str, int] | None = None) -> None:
        """Push the replies and release the entries still held, with their rows (taking
        ``answer_s``)."""
        time.sleep(self.answer_s)
        self.stats.update(counters or {})
        for entry, reply in answered:
            self.lists[entry.request.reply].append(reply.encode())
            if self._pending.pop(entry.entry_id, None) is not None:
                self.rows_waiting -= entry.rows
        self.suspect = None

    def settle(self) -> None:
        """Answers apply at once: nothing to wait for."""

    def on_trial(self, entry: Entry) -> None:
        self.suspect = entry.entry_id

    def dead_letter(self, dlq: str, entries: list[Entry], reason: str) -> None:
        self.dead_letters[dlq].extend((entry, reason) for entry in entries)

    def count(self, counters: Mapping[str, int]) -> None:
        self.stats.update(counters)

    def note(self, name: str, value: int) -> None:
        self.stats[name] = value

    @property
    def counts_pending(self) -> bool:
        """Statistics land at once: none wait."""
        return False

    def flush_counts(self, force: bool = False) -> None:
        """Statistics land at once: nothing to flush."""

    def reconciler(self, max_entry_rows: int) -> MemoryReconciler:
        return MemoryReconciler(self)


@dataclass(slots=True)
class MemoryReclaimer:
    """Hands the loop, at each step, the entries a dead consumer left (see
    :meth:`MemoryStreams.put`)."""

    streams: MemoryStreams
    batch_seconds: list[float] = field(default_factory=list)
    """Every batch time the loop reported."""

    def due(self, now: float) -> bool:
        return True

    def poll(self, now: float, room: int) -> list[Entry]:
        return self.streams.claim(room)

    def observe_batch(self, seconds: float) -> None:
        self.batch_seconds.append(seconds)


@dataclass(slots=True)
class MemoryReconciler:
    """Sets the rows-waiting counter to the rows in the streams, on the real schedule:
    at the first step, every ``interval_s``, and at once when data may have been lost."""

    streams: MemoryStreams
    interval_s: float = RECONCILE_EVERY_S
    _next: float = 0.0

    def suspect(self, why: str) -> None:
        self._next = 0.0

    def due(self, now: float) -> bool:
        return now >= self._next

    def run(self, now: float) -> tuple[int, int]:
        self._next = now + self.interval_s
        before, after = self.streams.rows_waiting, self.streams.rows_in_streams()
        self.streams.rows_waiting = after
        return before, after
