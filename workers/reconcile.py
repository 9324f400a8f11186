"""Keeping a model's rows-waiting counter true to its streams.

The counter (``cv:{m}:rows``) is what admission checks ``max_queue_rows`` against; a counter
above the rows really waiting turns requests away (503, queue full) although the queue is empty.
Admission adds an entry and its rows in one step (admit_many.lua), and release.lua
deletes answered entries and releases the rows of exactly those it deleted, so by itself
the counter equals the rows of the entries in the streams, across Redis restarts too. What
can still part them: keys evicted or deleted by hand, a restore of older data, a worker of
an older version releasing in several commands, and a large request's two-step admission
(admit_rows.lua reserves its rows, a plain XADD appends it: api/admission.py) cut between
its steps by its API process's death, or reconciled between them.

So each inference process recomputes the counter with reconcile.lua every
:data:`RECONCILE_EVERY_S`, and at once when Redis may have lost data: a consumer group
gone (NOGROUP), or Redis answering again after an error (a restart, a failover). A model
with several partitions (``queue.partitions``) has a counter per partition, each
recomputed from its own partition's streams (one script call each: one slot each).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis
from redis.commands.core import Script

from batching.keys import Partition
from batching.lua import script

log = logging.getLogger("conveyor.reconcile")

RECONCILE_EVERY_S = 2.0
"""A drifted counter is corrected at most this late."""
SCAN_BYTES = 1 << 20
"""Streams up to this size are read entry by entry for an exact sum (about a millisecond
of Redis time); larger ones only bound the counter by their entry count."""
RECONCILE_LUA = script("reconcile").text


@dataclass(slots=True)
class RowsReconciler:
    client: redis.Redis
    rows_key: str
    streams: list[str]
    max_entry_rows: int
    """The most rows one entry may hold: the model's ``max_batch_size``."""
    interval_s: float = RECONCILE_EVERY_S
    partitions: Sequence[Partition] = ()
    """The model's other partitions (``rows_key`` and ``streams`` are partition 0's)."""
    _next: float = 0.0
    _script: Script = field(init=False)

    def __post_init__(self) -> None:
        self._script = self.client.register_script(RECONCILE_LUA)

    def suspect(self, why: str) -> None:
        """Redis may have lost data (``why``): reconcile at the next step."""
        if self._next:
            log.info("%s: %s; reconciling the rows-waiting counter", self.rows_key, why)
        self._next = 0.0

    def due(self, now: float) -> bool:
        return now >= self._next

    def run(self, now: float) -> tuple[int, int]:
        """Set each counter to the rows in its streams; return their sum before and after."""
        self._next = now + self.interval_s
        total_before = total_after = 0
        parts = [(self.rows_key, self.streams), *((p.rows, p.streams) for p in self.partitions)]
        for rows_key, streams in parts:
            before, after = self._script(keys=[rows_key, *streams],
                                         args=[self.max_entry_rows, SCAN_BYTES])
            if before != after:
                log.warning("%s said %d rows wait; corrected to %d from the streams",
                            rows_key, before, after)
            total_before += int(before)
            total_after += int(after)
        return total_before, total_after
