"""The reads of an inference process: every partition of its model (``queue.partitions``),
highest priority first.

On one server (or a Sentinel-watched primary) a read is one ``XREADGROUP`` over every
partition's streams, level 1 of each partition, then level 2 of each, and so on, blocking
as asked: Redis hands back what any of them holds, the moment one has something. On a
Redis Cluster each partition is a slot of its own, so each is read by an ``XREADGROUP``
of its own, all of them in one write (each to its node). Those reads do not block: a read
blocked on one node would hold back the others' replies until it timed out. A read of a
model with several partitions on a cluster that finds nothing waits instead
(:class:`IdleWait`) and reads again. Either way the entries come back by priority level,
each level's partitions together.

``XREADGROUP``'s ``COUNT`` is per stream: each partition's streams are read with the
room split over the partitions (rounded up), so one read takes about the room, not N
times it, when every partition holds work. Each read also fetches every partition's
withdrawn set (``ZRANGE``), in the same write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from batching.envelope import ROWS_FIELD
from batching.former import Entry
from batching.keys import GROUP, Partition
from batching.resp import Command

IDLE_MIN_S = 0.001
"""A cluster read of several partitions that found nothing first waits this long..."""
IDLE_MAX_S = 0.02
"""...doubling while nothing arrives, up to this: an idle inference process reads about
fifty times a second, and a request that finds it idle waits at most this for its read."""


@dataclass(frozen=True, slots=True)
class Reads:
    """The commands of one read and their replies taken apart."""

    parts: tuple[Partition, ...]
    """The model's partitions, 0 first."""
    consumer: str
    splits: bool
    """The link sends each slot's commands to its node on its own (a Redis Cluster)."""
    marks: bool = True
    """Fetch each partition's withdrawn set with the read."""
    level: dict[str, int] = field(init=False)
    """Stream -> its priority level (1 = highest)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", {s: i + 1 for p in self.parts
                                           for i, s in enumerate(p.streams)})

    @property
    def streams(self) -> list[str]:
        """Every stream of every partition, by priority level, each level's partitions in
        order."""
        levels = len(self.parts[0].streams)
        return [p.streams[i] for i in range(levels) for p in self.parts]

    @property
    def blocks(self) -> bool:
        """Whether a read may block in Redis: not one of several slots on a cluster."""
        return not self.splits or len(self.parts) == 1

    def commands(self, count: int, block_ms: int | None, levels: int | None) -> list[Command]:
        """The read of up to ``count`` new entries of the top ``levels`` priority levels
        (None: all), blocking ``block_ms`` where it may, and the withdrawn sets."""
        share = -(-count // len(self.parts))
        head: list[str | int] = ["XREADGROUP", "GROUP", GROUP, self.consumer, "COUNT", share]
        if block_ms is not None and self.blocks:
            head += ["BLOCK", block_ms]
        if self.splits:
            reads = [_streams(head, list(p.streams[:levels])) for p in self.parts]
        else:
            top = len(self.parts[0].streams) if levels is None else levels
            reads = [_streams(head, [s for s in self.streams if self.level[s] <= top])]
        marks: list[Command] = [("ZRANGE", p.withdrawn, 0, -1) for p in self.parts] \
            if self.marks else []
        return [*reads, *marks]

    def entries(self, replies: list[Any]) -> tuple[list[tuple[str, Any]], list[bytes] | None]:
        """The replies of :meth:`commands`: (stream, items) by priority level, and the
        withdrawn sets' members together (None when not fetched)."""
        reads = len(replies) - (len(self.parts) if self.marks else 0)
        got = [(text(stream), items) for reply in replies[:reads] for stream, items in reply or []]
        if self.splits:
            got.sort(key=lambda item: self.level[item[0]])
        if not self.marks:
            return got, None
        return got, [m for members in replies[reads:] for m in members]


class IdleWait:
    """How long a read that may not block waits after finding nothing."""

    __slots__ = ("_wait_s",)

    def __init__(self) -> None:
        self._wait_s = IDLE_MIN_S

    def found(self, anything: bool) -> None:
        """A read found entries (``anything``), or found none and waits now."""
        if anything:
            self._wait_s = IDLE_MIN_S
            return
        time.sleep(self._wait_s)
        self._wait_s = min(self._wait_s * 2, IDLE_MAX_S)


def mark(entry: Entry) -> str:
    """An entry's member in the withdrawn set, as batching/lua/withdraw.lua writes it."""
    return f"{entry.stream} {entry.entry_id}"


def marks_of(members: list[bytes]) -> dict[str, str]:
    """The withdrawn sets' members as entry id -> stream."""
    marks = {}
    for member in members:
        stream, _, entry_id = text(member).rpartition(" ")
        marks[entry_id] = stream
    return marks


def _streams(head: list[str | int], names: list[str]) -> Command:
    return (*head, "STREAMS", *names, *(">" for _ in names))


def fields_of(fields: Any) -> dict[bytes, bytes]:
    """An entry's fields as a dict: redis-py gives one, the lean client a flat
    ``[name, value, ...]`` list."""
    if isinstance(fields, list):
        return dict(zip(fields[::2], fields[1::2], strict=True))
    if not isinstance(fields, dict):
        raise TypeError(f"entry fields are a {type(fields).__name__}")
    return fields


def entry_rows(fields: Any) -> int:
    """The rows an entry holds, from its ``r`` field; 0 when even that is unreadable."""
    try:
        return max(0, int(fields_of(fields)[ROWS_FIELD]))
    except (KeyError, ValueError, TypeError):
        return 0


def text(value: bytes | str | int) -> str:
    """A reply's bytes as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
