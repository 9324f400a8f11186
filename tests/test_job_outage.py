"""A job runner that lost Redis sends its chunks in flight again once Redis answers: a
failover to a replica, or a restart, may have lost their entries or their replies, and
waiting for their deadlines (minutes) would stall the job."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batching.envelope import Tensor
from batching.job_record import JobRecord, JobState, pack_tensors
from batching.keys import Keys
from batching.settings import Settings
from tests.procs import RedisServer, wait_for
from workers.job_runner import JobRunner


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of this test's own: it drops every client's connection."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()


def test_chunks_in_flight_are_sent_again_after_redis_was_unreachable(
        own_redis: RedisServer, keys: Keys) -> None:
    client = redis.Redis.from_url(own_redis.url, socket_timeout=5,
                                  retry=Retry(NoBackoff(), 0))  # the first failure surfaces
    record = JobRecord(id=uuid.uuid4().hex, model="m", state=JobState.PENDING, total=8,
                       priority=1, chunk_rows=2, max_queue_rows=1000, created_at=time.time())
    client.set(keys.job_input(record.id),
               pack_tensors([Tensor.from_array("x", np.zeros((8, 4), np.float32))]))
    client.hset(keys.job(record.id), mapping=cast(Mapping[Any, str], record.to_hash()))
    stop = threading.Event()
    runner = JobRunner(client, keys, Settings(redis_url=own_redis.url, job_max_in_flight=2),
                       record, lambda _done, _total: None, stop.is_set)
    assert runner.acquire()
    assert runner.start() is JobState.PENDING
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    stream = keys.queue("m", 1)
    with redis.Redis.from_url(own_redis.url) as watcher:
        try:
            wait_for(lambda: watcher.xlen(stream) == 2, 10, "two chunks in flight")
            time.sleep(0.5)
            assert watcher.xlen(stream) == 2  # nobody answers: they stay in flight
            watcher.client_kill_filter(_type="normal", skipme=True)  # the runner's too
            wait_for(lambda: watcher.xlen(stream) == 4, 10, "the two chunks sent again")
        finally:
            stop.set()
            thread.join(10)
            client.close()
