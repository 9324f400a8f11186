"""An inference process's Redis side: read a model's streams, answer and acknowledge entries.

Reads take the highest priority first. Answers for a whole batch go out in one pipeline:
the replies (pushed onto each API process's reply list, with a TTL so a vanished API
leaves nothing behind), then XACK and XDEL of the entries.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping

import redis
from redis.exceptions import ResponseError

from batching.envelope import FIELD, Reply, Request
from batching.former import Entry
from batching.keys import GROUP

log = logging.getLogger(__name__)

REPLY_TTL_S = 300
"""A reply list nobody pops (its API process died) expires after this."""


class ModelStreams:
    def __init__(self, client: redis.Redis, streams: list[str], stats_key: str,
                 consumer: str) -> None:
        self._redis = client
        self.streams = streams
        self.stats_key = stats_key
        self.consumer = consumer

    def ensure_groups(self) -> None:
        """Create the consumer group on every stream (from the start: nothing is skipped)."""
        for stream in self.streams:
            try:
                self._redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """New entries, highest priority stream first; ``block_ms=None`` does not block."""
        try:
            result = self._redis.xreadgroup(GROUP, self.consumer,
                                            dict.fromkeys(self.streams, ">"),
                                            count=count, block=block_ms)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_groups()  # Redis lost its data (restart without persistence)
            return []
        now = time.time()
        entries = []
        for stream, items in result or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            for raw_id, fields in items:
                entry_id = raw_id.decode()
                try:
                    request = Request.decode(fields[FIELD])
                except (KeyError, ValueError, TypeError) as exc:
                    log.error("dropping unreadable entry %s %s: %s", name, entry_id, exc)
                    self._drop(name, entry_id)
                    continue
                entries.append(Entry(name, entry_id, request, now))
        return entries

    def answer(self, answered: Iterable[tuple[Entry, Reply]],
               counters: Mapping[str, int] | None = None) -> None:
        """Send every reply, add ``counters`` to the stats hash, XACK and XDEL the entries.

        One round trip for the whole batch.
        """
        pipe = self._redis.pipeline(transaction=False)
        by_reply: dict[str, list[bytes]] = defaultdict(list)
        by_stream: dict[str, list[str]] = defaultdict(list)
        for entry, reply in answered:
            by_reply[entry.request.reply].append(reply.encode())
            by_stream[entry.stream].append(entry.entry_id)
        for key, blobs in by_reply.items():
            pipe.rpush(key, *blobs)
            pipe.expire(key, REPLY_TTL_S)
        for stream, ids in by_stream.items():
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)
        for name, amount in (counters or {}).items():
            pipe.hincrby(self.stats_key, name, amount)
        pipe.execute()

    def _drop(self, stream: str, entry_id: str) -> None:
        """An entry that cannot be decoded has no reply address: acknowledge and delete it."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()
