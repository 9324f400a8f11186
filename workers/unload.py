"""What an unloaded model leaves behind: requests still unread in its streams.

Its inference processes stop reading at the unload and finish only what they hold. The
rest would wait for their deadlines (a 504, seconds later) although nothing will ever run
them, so the supervisor that stopped the processes reads them off and answers each with
the 404 a new request for the model gets. Entries already delivered to a process are left
alone: that process answers them, or, if it died, its replacement's claim does after a
reload.
"""

from __future__ import annotations

import logging
import os
import socket

import redis

from batching.envelope import Reply
from batching.errors import ModelNotFound
from batching.keys import GROUP, Keys
from batching.resp import Address, Connection
from workers.streams import ModelStreams

log = logging.getLogger(__name__)

READ_COUNT = 256


def turn_away(client: redis.Redis, redis_url: str, keys: Keys, model: str, levels: int) -> int:
    """Answer every unread request of ``model`` with a 404; return how many."""
    consumer = f"{socket.gethostname()}:{os.getpid()}:{model}:unloaded"
    link = Connection(Address.from_url(redis_url), timeout_s=5.0)
    streams = ModelStreams(client, link, keys.queues(model, levels), keys.stats(model),
                           keys.rows_waiting(model), consumer)
    error = ModelNotFound(f"model {model!r} was unloaded before this request ran")
    answered = 0
    try:
        while entries := streams.read(READ_COUNT, None):
            streams.answer([(e, Reply(e.request.id, error_code=error.code, error=error.message))
                            for e in entries], {"fail_count": len(entries)})
            answered += len(entries)
        streams.flush_counts(force=True)
        for stream in streams.streams:
            client.xgroup_delconsumer(stream, GROUP, consumer)
    finally:
        link.close()
    if answered:
        log.info("%s unloaded: answered %d unread requests with 404", model, answered)
    return answered
