"""An inference process's Redis side: read a model's streams, answer and acknowledge entries.

Reads take the highest priority first. Answers for a whole batch go out in one write:
the batch's statistics (stats.lua), the replies (pushed onto each API process's reply
list, with a TTL so a vanished API leaves nothing behind), then release.lua per stream,
which acknowledges and deletes the entries and releases the rows of those it deleted
from the queue limit, in one step. On a single Redis (or a Sentinel-watched primary) that
write is one pipeline on one connection and Redis applies it in that order: the
statistics count a request before its client can have the answer, and an entry is
released only after its reply is pushed, so a write cut short leaves it pending, for the
reclaimer to re-run.
A Redis Cluster applies the commands of one write node by node, each node on its own (a
reply list lives on its API process's slot, the rest on the model's), so there an answer
is two writes, one round trip apart: the statistics and the replies, then, only once
every reply push has answered with its list's length, the releases. A push that fails
(a lost connection, ``CLUSTERDOWN``, a redirection too many, an error reply) leaves the
batch's entries pending, to be re-run: at least once, and an API ignores a reply for a
request it no longer waits for. The lean client and redis-py's cluster pipeline
(``CONVEYOR_LEAN_REDIS=0``) answer alike. On a cluster the statistics reach the model's
node while the replies reach theirs, not before: a client can have its answer a moment
before it is counted. A batch re-run after a failed push (or a single Redis's write cut
short after the statistics) is counted twice.
Each read also fetches, in the same round trip, the model's withdrawn set: entries whose
clients left after a worker read them (batching/lua/withdraw.lua). The loop drops those it
holds unrun, and :meth:`ModelStreams.withdraw` releases them like an answer, without a
reply.
A model with several partitions (``queue.partitions``) has streams, a rows counter and a
withdrawn set per partition: a read takes every partition's (workers/stream_reads.py), and
each entry is released, and its mark removed, in its own partition's keys. On a cluster
the statistics of such a model go every ``SPREAD_FLUSH_S``, not with each answer.
Reads and answers, once per batch, use the lean client of :mod:`batching.resp`, and an
answer's replies are read with the next read's (on a cluster, its releases' replies);
the rarer calls (claims, dead letters) use redis-py.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis
from redis.exceptions import ResponseError

from batching.envelope import FIELD, Reply, Request
from batching.former import Entry
from batching.keys import GROUP, Partition
from batching.lua import script
from batching.redis_links import BlockingLink
from batching.resp import Command, RespError
from workers.reconcile import RowsReconciler
from workers.stream_reads import IdleWait, Reads, entry_rows, fields_of, mark, marks_of, text

log = logging.getLogger(__name__)

REPLY_TTL_S = 300
"""A reply list nobody pops (its API process died) expires after this."""
FLUSH_EVERY_S = 0.1
"""Counters not sent with an answer (reclaims, out-of-memory splits) reach Redis at most
this late while a model is busy."""
SPREAD_FLUSH_S = 0.5
"""On a cluster, for a model of several partitions: counters go at most this often, not
with every answer. The stats hash is one slot, partition 0's: a write per batch would load
its node well past the others' (a batch's statistics hold some thirty fields)."""
DLQ_MAXLEN = 10_000
"""The dead-letter stream keeps about this many of the latest failures."""


def _code(text: str) -> bytes:
    """A script's text without its comment lines, to send with each EVAL: Redis hashes the
    text it gets with every call, about 2 µs a kilobyte."""
    return "\n".join(line for line in text.splitlines()
                     if line.strip() and not line.lstrip().startswith("--")).encode()


RELEASE_LUA = _code(script("release").text)
"""Sent whole with each EVAL: nothing to reload when a restarted Redis lost its scripts
(Redis caches it by its hash, which costs it a microsecond per call)."""
STATS_LUA = _code(script("stats").text)


def _no_loss(why: str) -> None:
    """The default listener for lost data: nobody is told."""


class ModelStreams:
    def __init__(self, client: redis.Redis, link: BlockingLink, streams: list[str], stats_key: str,
                 rows_key: str, consumer: str, busy_poll_s: float = 0.0, *,
                 suspects_key: str, withdrawn_key: str | None = None,
                 more: tuple[Partition, ...] = ()) -> None:
        """``streams``, ``rows_key`` and ``withdrawn_key`` are partition 0's; ``more`` the
        model's other partitions (``queue.partitions`` above 1). The withdrawn sets are
        fetched with every read (``withdrawn_key`` None: never fetched)."""
        self._redis = client
        self.parts = (Partition(tuple(streams), rows_key, withdrawn_key or ""), *more)
        self._part_of = {stream: part for part in self.parts for stream in part.streams}
        """Stream -> the partition it belongs to."""
        self._reads = Reads(self.parts, consumer, link.splits, withdrawn_key is not None)
        self._idle = IdleWait()
        self.withdrawn: dict[str, str] = {}
        """Marks fetched with the last read: entry id -> stream (empty: none)."""
        self.suspects_key = suspects_key
        self._on_trial = False
        self.busy_poll_s = busy_poll_s
        self._link = link
        self.streams = self._reads.streams
        """Every partition's streams, by priority level."""
        self.stats_key = stats_key
        self._counts: Counter[str] = Counter()
        self._latest: dict[str, int] = {}
        self._next_flush = 0.0
        self._flush_s = SPREAD_FLUSH_S if link.splits and len(self.parts) > 1 else 0.0
        """Counters go with an answer at most this often (0: with every one)."""
        self.consumer = consumer
        self.on_data_lost: Callable[[str], None] = _no_loss
        """Told when Redis shows it lost data (a consumer group gone)."""

    def on_missing_group(self, exc: ResponseError | RespError) -> None:
        """Redis lost its data (a restart without persistence): recreate the groups."""
        if "NOGROUP" not in str(exc):
            raise exc
        self.ensure_groups()
        self.on_data_lost("a consumer group was gone")

    def reconciler(self, max_entry_rows: int) -> RowsReconciler:
        """What keeps the rows-waiting counter true to these streams (``max_entry_rows``:
        the model's ``max_batch_size``), on the same Redis client."""
        first = self.parts[0]
        return RowsReconciler(self._redis, first.rows, list(first.streams),
                              max_entry_rows, partitions=self.parts[1:])

    def ensure_groups(self) -> None:
        """Create the consumer group on every stream (from the start: nothing is skipped)."""
        for stream in self.streams:
            try:
                self._redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def pending_by_consumer(self, stream: str) -> dict[str, int]:
        """Consumers with unacknowledged entries on ``stream``, and how many each holds."""
        summary = self._redis.xpending(stream, GROUP)
        return {text(c["name"]): int(c["pending"]) for c in summary.get("consumers") or []}

    def claim_from(self, stream: str, consumer: str, count: int) -> list[Entry]:
        """Take over up to ``count`` entries pending on ``consumer`` (a dead one), now.

        Its death counts as a delivery only for the entries it may have died of: those it
        held when first delivered (any could have been in its batch) and the re-delivered
        entry it was running alone. Re-delivered entries it merely held keep their count,
        so a request that kills process after process does not take its old neighbours to
        the dead-letter stream with it.

        Another live process may be claiming the same entries at the same time. Each
        XCLAIM asks for at least the idle time this call's XPENDING saw: a claim in
        between makes an entry idle afresh, so only one of two racing processes takes it
        and it runs once, not twice.
        """
        pending = self._redis.xpending_range(stream, GROUP, min="-", max="+", count=count,
                                             consumername=consumer)
        if not pending:
            return []
        blamed = text(self._redis.hget(self.suspects_key, consumer) or b"")
        deliveries: dict[str, int] = {}
        idle_ms: dict[str, int] = {}
        for p in pending:
            entry_id, times = text(p["message_id"]), int(p["times_delivered"])
            suspect = blamed == _trial(stream, entry_id)
            deliveries[entry_id] = times + 1 if times == 1 or suspect else times
            idle_ms[entry_id] = int(p["time_since_delivered"])
        claimed: list[Any] = []
        for times in sorted(set(deliveries.values())):
            named = [i for i, n in deliveries.items() if n == times]
            ids: list[int | bytes | str | memoryview[int]] = list(named)
            seen_idle = min(idle_ms[i] for i in named)
            claimed += self._redis.xclaim(stream, GROUP, self.consumer, seen_idle, ids,
                                          retrycount=times)
        if any(blamed == _trial(stream, i) for i in deliveries):  # blamed once: it has served
            self._redis.hdel(self.suspects_key, consumer)
        return self._entries(stream, sorted(claimed, key=lambda item: _order(item[0])),
                             deliveries)

    def on_trial(self, entry: Entry) -> None:
        """Record that this process runs ``entry``, re-delivered, alone: if it dies now,
        :meth:`claim_from` blames that entry only. Cleared with the next answer."""
        self._redis.hset(self.suspects_key, self.consumer, _trial(entry.stream, entry.entry_id))
        self._on_trial = True

    def autoclaim(self, stream: str, min_idle_ms: int, count: int) -> list[Entry]:
        """Take over entries idle longer than ``min_idle_ms`` on any consumer (a stuck one)."""
        result = self._redis.xautoclaim(stream, GROUP, self.consumer, min_idle_ms, "0-0",
                                        count=count)
        claimed = result[1] if result else []
        if not claimed:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for entry_id, _ in claimed:
            pipe.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
        deliveries = {text(p[0]["message_id"]): int(p[0]["times_delivered"])
                      for p in pipe.execute() if p}
        return self._entries(stream, claimed, deliveries)

    def dead_letter(self, dlq: str, entries: list[Entry], reason: str) -> None:
        """Record entries that failed too often in the dead-letter stream (capped)."""
        pipe = self._redis.pipeline(transaction=False)
        for entry in entries:
            pipe.xadd(dlq, {"id": entry.request.id, "stream": entry.stream,
                            "entry": entry.entry_id, "deliveries": entry.deliveries,
                            "reason": reason, "request": entry.request.encode()},
                      maxlen=DLQ_MAXLEN, approximate=True)
        pipe.execute()

    def forget_idle_consumers(self, stream: str, live: set[str], idle_ms: int) -> None:
        """Delete group consumers that hold nothing, have no heartbeat and sat idle long."""
        for info in self._redis.xinfo_consumers(stream, GROUP):
            name = text(info["name"])
            if name not in live and int(info["pending"]) == 0 and int(info["idle"]) > idle_ms:
                self._redis.xgroup_delconsumer(stream, GROUP, name)
                self._redis.hdel(self.suspects_key, name)

    def read(self, count: int, block_ms: int | None, levels: int | None = None,
             poll: bool = False) -> list[Entry]:
        """New entries of the top ``levels`` priority levels (None: all), highest first;
        ``block_ms=None`` does not block. With ``poll``, a blocking read polls for the
        first ``busy_poll_s``, then sleeps. Several partitions on a cluster never block
        in Redis: a read that finds nothing waits a little instead (:class:`IdleWait`)."""
        commands = self._reads.commands(count, block_ms, levels)
        try:
            replies = self._link.execute(commands, self.busy_poll_s if poll else 0.0)
        except RespError as exc:
            self.on_missing_group(exc)
            return []
        got, members = self._reads.entries(replies)
        if members is not None and (members or self.withdrawn):
            self.withdrawn = marks_of(members)
        entries = []
        for stream, items in got:
            entries.extend(self._entries(stream, items, {}))
        if block_ms is not None and not self._reads.blocks:
            self._idle.found(bool(got))
        return entries

    def withdraw(self, entries: list[Entry]) -> None:
        """Release ``entries`` unrun, their clients gone: acknowledged, deleted, their rows
        off the queue limit and their marks removed, counted as ``withdrawn_count``, with
        no reply. Sent with the next write, like an answer."""
        by_stream: dict[str, list[str | int]] = defaultdict(list)
        for entry in entries:
            by_stream[entry.stream] += (entry.entry_id, entry.rows)
            self.withdrawn.pop(entry.entry_id, None)
        self._counts["withdrawn_count"] += len(entries)
        commands = self._due_counts() + self._releases(by_stream)
        if self._reads.marks:
            commands += self._unmark(entries)
        self._link.send(commands)

    def _releases(self, by_stream: dict[str, list[str | int]]) -> list[Command]:
        """release.lua for each stream's entries (ids and rows), on its partition's rows."""
        return [("EVAL", RELEASE_LUA, 2, self._part_of[stream].rows, stream, GROUP, *released)
                for stream, released in by_stream.items()]

    def _unmark(self, entries: list[Entry]) -> list[Command]:
        """The marks of ``entries`` off their partitions' withdrawn sets."""
        marks: dict[str, list[str]] = defaultdict(list)
        for entry in entries:
            marks[self._part_of[entry.stream].withdrawn].append(mark(entry))
        return [("ZREM", key, *members) for key, members in marks.items()]

    def _entries(self, stream: str, items: list[Any], deliveries: dict[str, int]) -> list[Entry]:
        now = time.time()
        entries = []
        for raw_id, fields in items:
            entry_id = text(raw_id)
            try:
                request = Request.decode(fields_of(fields)[FIELD])
            except (KeyError, ValueError, TypeError) as exc:
                log.error("dropping unreadable entry %s %s: %s", stream, entry_id, exc)
                self._drop(stream, entry_id, entry_rows(fields))
                continue
            entries.append(Entry(stream, entry_id, request, now, deliveries.get(entry_id, 1)))
        return entries

    def answer(self, answered: Iterable[tuple[Entry, Reply]],
               counters: Mapping[str, int] | None = None) -> None:
        """Add ``counters`` (and any still buffered) to the stats hash, send every reply
        and release the entries (XACK, XDEL and their rows off the queue limit, for those
        still there).

        On a single Redis: one write for the whole batch, whose replies are read with the
        next read's. The counters go first, so they are in the hash before any reply is
        out, and the releases after the replies. On a cluster, whose nodes each apply
        their part of a write on their own (:attr:`BlockingLink.splits`, the lean client
        and redis-py's alike), the counters and replies go out first and the releases
        only once every reply push has succeeded (:meth:`_answer_split`): one round trip
        more, waited for here.
        """
        self._counts.update(counters or {})
        due = not self._flush_s or time.monotonic() >= self._next_flush
        commands = self._due_counts() if self.counts_pending and due else []
        by_reply: dict[str, list[bytes]] = defaultdict(list)
        by_stream: dict[str, list[str | int]] = defaultdict(list)
        marked: list[Entry] = []
        for entry, reply in answered:
            by_reply[entry.request.reply].append(reply.encode())
            by_stream[entry.stream] += (entry.entry_id, entry.rows)
            if self.withdrawn and self.withdrawn.get(entry.entry_id) == entry.stream:
                del self.withdrawn[entry.entry_id]  # its client left while it ran
                marked.append(entry)
        for key, blobs in by_reply.items():
            commands.append(("RPUSH", key, *blobs))
            commands.append(("EXPIRE", key, REPLY_TTL_S))
        releases = self._releases(by_stream)
        if marked and self._reads.marks:
            # The mark of an entry that ran anyway goes with its release: the set that
            # every read fetches holds only entries still waiting.
            releases += self._unmark(marked)
        after: list[Command] = []
        if self._on_trial:
            self._on_trial = False
            after.append(("HDEL", self.suspects_key, self.consumer))
        if self._link.splits and releases:
            self._answer_split(commands + after, releases)
            return
        self._link.send(commands + releases + after)

    def _answer_split(self, pushes: list[Command], releases: list[Command]) -> None:
        """An answer on a cluster: send ``pushes`` (the counters, the replies, and the
        ``HDEL`` that ends a trial: the run is over, whatever becomes of its replies) and
        read their replies; send ``releases`` only when every ``RPUSH`` answered with its
        list's length. Otherwise the entries stay pending, and the reclaimer re-runs them.
        A lost connection raises, as a failed write does on a single Redis."""
        got: list[list[Any]] = []
        self._link.send(pushes, got.append)
        self._link.flush()
        replies = got[0] if got else []
        if len(replies) != len(pushes):
            log.warning("an answer's replies were not all confirmed: its entries stay "
                        "pending, to be re-run")
            return
        refused = []
        for command, reply in zip(pushes, replies, strict=True):
            if command[0] == "RPUSH" and not isinstance(reply, int):
                refused.append(f"{command[1]!r}: {reply}")
            elif isinstance(reply, Exception):
                log.error("Redis refused a command of an answer: %s", reply)
        if refused:
            log.warning("a reply push failed (%s): the batch's entries stay pending, to be "
                        "re-run", "; ".join(refused))
            return
        self._link.send(releases)

    def settle(self) -> None:
        """Wait until Redis has applied every answer sent. Run before each batch: a batch
        that kills the process must not take unapplied answers down with it (a socket
        closed with unread replies is reset, and Redis drops what it had not read yet)."""
        self._link.flush()

    def count(self, counters: Mapping[str, int]) -> None:
        """Add to the model's stats hash, with the next flush."""
        self._counts.update(counters)

    def note(self, name: str, value: int) -> None:
        """Set a field of the model's stats hash (a latest value, not a sum), with the
        next flush."""
        self._latest[name] = value

    @property
    def counts_pending(self) -> bool:
        return bool(self._counts or self._latest)

    def flush_counts(self, force: bool = False) -> None:
        """Send the buffered counters if any are due (all of them when ``force``)."""
        if self.counts_pending and (force or time.monotonic() >= self._next_flush):
            self._link.send(self._due_counts())
        if force:
            self._link.flush()

    def _due_counts(self) -> list[Command]:
        """Every buffered counter as one command (stats.lua) of two packed strings: a
        dozen HINCRBYs per batch would cost the process six times the Python of this one
        (about 20 µs against 3.5)."""
        commands: list[Command] = [(
            "EVAL", STATS_LUA, 1, self.stats_key,
            " ".join(f"{name} {amount}" for name, amount in self._counts.items()),
            " ".join(f"{name} {value}" for name, value in self._latest.items()))]
        self._counts.clear()
        self._latest.clear()
        self._next_flush = time.monotonic() + (self._flush_s or FLUSH_EVERY_S)
        return commands

    def _drop(self, stream: str, entry_id: str, rows: int) -> None:
        """An entry that cannot be decoded has no reply address: acknowledge and delete it,
        and release its rows from the queue limit."""
        self._redis.eval(RELEASE_LUA.decode(), 2, self._part_of[stream].rows, stream, GROUP,
                         entry_id, rows)


def _trial(stream: str, entry_id: str) -> str:
    """What :meth:`ModelStreams.on_trial` records: the stream and the entry id (ids of
    different streams may coincide)."""
    return f"{stream} {entry_id}"


def _order(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id's place in its stream."""
    ms, _, seq = text(entry_id).partition("-")
    return int(ms), int(seq or 0)
