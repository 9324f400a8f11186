"""A job runner that lost Redis sends its chunks in flight again once Redis answers: a
failover to a replica, or a restart, may have lost their entries or their replies, and
waiting for their deadlines (minutes) would stall the job. A chunk whose result could not
be written is sent again too: its reply is gone, and the job must end with every chunk."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batching.envelope import Reply, Request, Tensor
from batching.job_record import JobRecord, JobState, pack_tensors, unpack_tensors
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
            # A drop between two of the runner's commands goes unseen (redis-py reconnects
            # before the next one, and nothing is lost); one during its blocking pop, where it
            # spends nearly all its time, is seen. On a busy host the gaps grow: drop again
            # until one is seen (a drop seen late may have both chunks sent twice).
            deadline = time.monotonic() + 20
            while watcher.xlen(stream) < 4:
                assert time.monotonic() < deadline, "the two chunks were not sent again"
                watcher.client_kill_filter(_type="normal", skipme=True)  # the runner's too
                with contextlib.suppress(AssertionError):
                    wait_for(lambda: watcher.xlen(stream) >= 4, 2, "the two chunks sent again")
        finally:
            stop.set()
            thread.join(10)
            client.close()


MARK = "stored-y"
"""The name of the model's output here: it is in a command only where a result is written."""


def failing_once(landed: bool, fired: threading.Event, done: Callable[[], bool]
                 ) -> type[redis.Connection]:
    """A connection class whose first write of a chunk's result fails, whatever the command
    (a pipeline, a script): the connection drops before the write is sent (``landed``
    false: the write is lost), or after it ran, ``done`` saying so (its answer is lost)."""

    class FailingOnce(redis.Connection):
        answer_lost = False

        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            items = [command] if isinstance(command, bytes | str) else list(command)
            if not fired.is_set() and any(MARK.encode() in bytes(i) for i in items
                                          if not isinstance(i, str)):
                if not landed:
                    fired.set()
                    self.disconnect()  # type: ignore[no-untyped-call]
                    raise redis.ConnectionError("injected: dropped before the write")
                self.answer_lost = True
            super().send_packed_command(items, check_health)  # type: ignore[no-untyped-call]

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:  # a NOSCRIPT (the script is loaded and sent again) ran nothing: stay armed
                response = super().read_response(*args, **kwargs)
            except BaseException:
                self.answer_lost = False
                raise
            if self.answer_lost:
                self.answer_lost = False
                fired.set()
                wait_for(done, 5, "the write to land")
                self.disconnect()  # type: ignore[no-untyped-call]
                raise redis.ConnectionError("injected: dropped after the write, before its answer")
            return response

    return FailingOnce


def answer_chunks(url: str, stream: str, stop: threading.Event) -> None:
    """The model: y = 2x, for every chunk in ``stream``, as an inference process answers."""
    last = "0-0"
    with redis.Redis.from_url(url) as model:
        while not stop.is_set():
            for _, entries in model.xread({stream: last}, block=100):
                for entry_id, fields in entries:
                    last = entry_id
                    request = Request.decode(fields[b"d"])
                    y = request.inputs[0].array() * 2
                    model.rpush(request.reply, Reply(request.id, [Tensor.from_array(MARK, y)])
                                .encode())


@pytest.mark.parametrize("landed", [False, True], ids=["write-lost", "answer-lost"])
def test_a_result_write_that_failed_is_sent_again_and_counted_once(
        redis_server: RedisServer, keys: Keys, landed: bool) -> None:
    record = JobRecord(id=uuid.uuid4().hex, model="m", state=JobState.PENDING, total=7,
                       priority=1, chunk_rows=2, max_queue_rows=1000, created_at=time.time())
    chunks_key = keys.job_chunks(record.id)
    fired = threading.Event()
    watcher = redis.Redis.from_url(redis_server.url)
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5, retry=Retry(NoBackoff(), 0),
                                  connection_class=failing_once(
                                      landed, fired, lambda: watcher.hlen(chunks_key) > 0))
    x = np.arange(28, dtype=np.float32).reshape(7, 4)
    client.set(keys.job_input(record.id), pack_tensors([Tensor.from_array("x", x)]))
    client.hset(keys.job(record.id), mapping=cast(Mapping[Any, str], record.to_hash()))
    progress: list[int] = []
    stop = threading.Event()
    runner = JobRunner(client, keys, Settings(redis_url=redis_server.url, job_max_in_flight=2),
                       record, lambda done, _total: progress.append(done), stop.is_set)
    model = threading.Thread(target=answer_chunks,
                             args=(redis_server.url, keys.queue("m", 1), stop), daemon=True)
    model.start()
    ended: list[JobState] = []
    try:
        assert runner.acquire()
        assert runner.start() is JobState.PENDING
        job = threading.Thread(target=lambda: ended.append(runner.run()), daemon=True)
        job.start()
        job.join(30)
        assert fired.is_set()
        assert ended == [JobState.SUCCEEDED]
        stored = watcher.hgetall(chunks_key)
        assert sorted(stored) == [b"0", b"1", b"2", b"3"]  # every chunk: none lost
        y = np.concatenate([unpack_tensors(cast(bytes, stored[str(i).encode()]))[0].array()
                            for i in range(4)])
        np.testing.assert_array_equal(y, x * 2)
        assert progress == sorted(progress) and progress[-1] == 7  # each row counted once
        assert watcher.hget(keys.job(record.id), "done") == b"7"
        assert watcher.hget(keys.stats("m"), "job_rows") == b"7"
    finally:
        stop.set()
        model.join(10)
        client.close()
        watcher.close()
