"""What the inference loop needs of its streams, of claims and of reconciliation.

:class:`workers.inference.InferenceLoop` is written against these protocols, not against
Redis: in a worker they are :class:`workers.streams.ModelStreams`,
:class:`workers.recovery.Reclaimer` and :class:`workers.reconcile.RowsReconciler`; in a
unit test they are the in-memory ones of :mod:`workers.memory_streams`, so the loop can be
driven step by step without a Redis server. Protocols cost nothing per call, so the hot
path stays as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from batching.envelope import Reply
from batching.former import Entry


class ReconcilePort(Protocol):
    """Keeps the model's rows-waiting counter true to its streams."""

    def suspect(self, why: str) -> None:
        """The streams may have lost data (``why``): reconcile at the next step."""
        ...

    def due(self, now: float) -> bool:
        ...

    def run(self, now: float) -> tuple[int, int]:
        """Set the counter to the rows in the streams; return it before and after."""
        ...


class StreamPort(Protocol):
    """A model's request streams as one inference process sees them."""

    streams: list[str]
    """The request streams (every partition's), highest priority first."""
    on_data_lost: Callable[[str], None]
    """Told when the streams show they lost data."""

    def read(self, count: int, block_ms: int | None, levels: int | None = None,
             poll: bool = False) -> list[Entry]:
        """New entries of the top ``levels`` priority levels (None: all), highest
        priority first; ``block_ms=None`` does not block. Also refreshes :attr:`withdrawn`."""
        ...

    withdrawn: dict[str, str]
    """Entries whose clients left, as the last read saw them: entry id -> stream."""

    def withdraw(self, entries: list[Entry]) -> None:
        """Release ``entries`` unrun (their clients left) and count them, with no reply."""
        ...

    def answer(self, answered: Iterable[tuple[Entry, Reply]],
               counters: Mapping[str, int] | None = None) -> None:
        """Add ``counters`` to the statistics, then send the replies and release the
        entries after them (on a cluster, only once every reply push has succeeded). On
        a single Redis the statistics count a reply before it is out; on a cluster they
        go out with the replies (workers/streams.py)."""
        ...

    def settle(self) -> None:
        """Wait until every answer sent has been applied (before each batch)."""
        ...

    def on_trial(self, entry: Entry) -> None:
        """This process runs ``entry``, re-delivered, alone: a death now is blamed on it."""
        ...

    def dead_letter(self, dlq: str, entries: list[Entry], reason: str) -> None:
        """Record entries that failed too often in the dead-letter stream ``dlq``."""
        ...

    def count(self, counters: Mapping[str, int]) -> None:
        """Add to the model's statistics, with the next answer or flush."""
        ...

    def note(self, name: str, value: int) -> None:
        """Set a latest value in the model's statistics, with the next answer or flush."""
        ...

    @property
    def counts_pending(self) -> bool:
        """Statistics wait to be flushed."""
        ...

    def flush_counts(self, force: bool = False) -> None:
        """Send the buffered statistics if due (all of them when ``force``)."""
        ...

    def reconciler(self, max_entry_rows: int) -> ReconcilePort:
        """What keeps these streams' rows-waiting counter true; ``max_entry_rows`` is the
        most rows one entry may hold."""
        ...


class ReclaimPort(Protocol):
    """Takes over the entries that dead or stuck consumers left pending."""

    def due(self, now: float) -> bool:
        ...

    def poll(self, now: float, room: int) -> list[Entry]:
        """Claim up to ``room`` entries, each with its count of deliveries."""
        ...

    def observe_batch(self, seconds: float) -> None:
        """A batch took ``seconds``: how long a live consumer may hold an entry follows."""
        ...
