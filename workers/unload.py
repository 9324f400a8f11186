"""What an unloaded model leaves behind: requests still unread in its streams.

Its inference processes stop reading at the unload and finish only what they hold. The
rest would wait for their deadlines (a 504, seconds later) although nothing will ever run
them, so the supervisor that stopped the processes reads them off and answers each with
the 404 a new request for the model gets. Entries already delivered to a process are left
alone: that process answers them, or, if it died, its replacement's claim does after a
reload.

A reload may come at any moment. The drain starts only while the model is still marked
unloaded, and stops at the first entry appended after it started: that one, and what
follows, was admitted for the reloaded model. Such an entry stays pending on the drain's
consumer, which has no heartbeat, so a serving process claims and runs it.
"""

from __future__ import annotations

import logging
import os
import socket

import redis

from batching.envelope import Reply
from batching.errors import ModelNotFound
from batching.keys import GROUP, Keys
from batching.redis_links import blocking_link
from batching.repository_scan import parse_record
from workers.streams import ModelStreams

log = logging.getLogger(__name__)

READ_COUNT = 256


def turn_away(client: redis.Redis, redis_url: str, keys: Keys, model: str, levels: int,
              partitions: int = 1) -> int:
    """Answer the requests of ``model`` (in each of its ``partitions``) left unread by its
    unload with a 404; return how many."""
    if not _unloaded(client, keys, model):
        return 0
    seconds, micros = client.time()
    cutoff_ms = int(seconds) * 1000 + int(micros) // 1000
    consumer = f"{socket.gethostname()}:{os.getpid()}:{model}:unloaded"
    link = blocking_link(redis_url, timeout_s=5.0)
    first, *more = keys.partitions(model, levels, partitions)
    streams = ModelStreams(client, link, list(first.streams), keys.stats(model), first.rows,
                           consumer, suspects_key=keys.suspects(model), more=tuple(more))
    error = ModelNotFound(f"model {model!r} was unloaded before this request ran")
    answered, left = 0, False
    try:
        while not left and (entries := streams.read(READ_COUNT, None)):
            if not _unloaded(client, keys, model):
                left = True  # reloaded: what was read stays pending, for a serving process
                break
            old = [e for e in entries if int(e.entry_id.split("-")[0]) < cutoff_ms]
            left = len(old) < len(entries)
            streams.answer([(e, Reply(e.request.id, error_code=error.code, error=error.message))
                            for e in old], {"fail_count": len(old)})
            answered += len(old)
        streams.flush_counts(force=True)
        if not left:  # nothing is pending on this consumer: it can go
            for stream in streams.streams:
                client.xgroup_delconsumer(stream, GROUP, consumer)
    finally:
        link.close()
    if answered:
        log.info("%s unloaded: answered %d unread requests with 404", model, answered)
    return answered


def _unloaded(client: redis.Redis, keys: Keys, model: str) -> bool:
    raw = client.hget(keys.repository(), model)
    return parse_record(raw).state == "unloaded"
