"""The rows-waiting counter stays true to the streams: exact releases, reconciliation, and
reconciliation at once when Redis restarts and loses its data (issue 10, item 12)."""

from __future__ import annotations

import asyncio
import multiprocessing
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis

from api.dispatch import Admission, Dispatcher
from batching.envelope import Reply, Request, Tensor
from batching.errors import DeadlineExceeded
from batching.keys import GROUP, Keys
from batching.repository_scan import load_model_config
from batching.resp import Address, Connection
from tests.conftest import TEST_MODELS, Stack
from tests.procs import RedisServer, wait_for
from workers.backends import load_model
from workers.inference import InferenceLoop
from workers.reconcile import RECONCILE_EVERY_S, SCAN_BYTES, RowsReconciler
from workers.recovery import Reclaimer
from workers.shared_state import SharedState
from workers.streams import ModelStreams

MODEL = "echo"


OPENED: list[redis.Redis | Connection] = []
"""Connections streams_on made; closed after each test."""


@pytest.fixture(autouse=True)
def close_opened() -> Iterator[None]:
    yield
    while OPENED:
        OPENED.pop().close()


def streams_on(url: str, keys: Keys, consumer: str = "c1") -> ModelStreams:
    client = redis.Redis.from_url(url)
    link = Connection(Address.from_url(url), timeout_s=5.0)
    OPENED.extend([client, link])
    streams = ModelStreams(client, link, keys.queues(MODEL, 3), keys.stats(MODEL),
                           keys.rows_waiting(MODEL), consumer, suspects_key=keys.suspects(MODEL))
    streams.ensure_groups()
    return streams


def admit(client: redis.Redis, keys: Keys, rows: int, width: int = 4, priority: int = 2
          ) -> None:
    """What admit_many.lua does for a request of ``rows`` rows of ``width`` floats."""
    x = Tensor.from_array("x", np.zeros((rows, width), np.float32))
    request = Request(uuid.uuid4().hex, "cv:reply:test", 0, 0, priority, [x])
    client.xadd(keys.queue(MODEL, priority), {"d": request.encode(), "r": rows})
    client.incrby(keys.rows_waiting(MODEL), rows)


def rows(client: redis.Redis, keys: Keys) -> int:
    return int(client.get(keys.rows_waiting(MODEL)) or 0)


def reconciler(client: redis.Redis, keys: Keys, max_rows: int = 8) -> RowsReconciler:
    return RowsReconciler(client, keys.rows_waiting(MODEL), keys.queues(MODEL, 3), max_rows)


def test_release_takes_off_only_the_rows_of_entries_it_deleted(
        redis_server: RedisServer, client: redis.Redis, keys: Keys) -> None:
    admit(client, keys, 3)
    admit(client, keys, 2)
    streams = streams_on(redis_server.url, keys)
    entries = streams.read(10, None)
    assert [e.rows for e in entries] == [3, 2]
    streams.answer([(entries[0], Reply(entries[0].request.id))])
    streams.settle()
    assert rows(client, keys) == 2
    # Answered again (a reclaimed entry whose first reader answered after all), or answered
    # after a restart lost it: nothing is left to release.
    streams.answer([(e, Reply(e.request.id)) for e in entries])
    streams.settle()
    assert rows(client, keys) == 0
    assert client.xlen(keys.queue(MODEL, 2)) == 0
    assert client.xpending(keys.queue(MODEL, 2), GROUP)["pending"] == 0


def test_an_unreadable_entry_releases_its_rows_once(
        redis_server: RedisServer, client: redis.Redis, keys: Keys) -> None:
    client.xadd(keys.queue(MODEL, 1), {"d": b"\xc1", "r": 4})
    client.incrby(keys.rows_waiting(MODEL), 4)
    streams = streams_on(redis_server.url, keys)
    assert streams.read(10, None) == []
    assert rows(client, keys) == 0 and client.xlen(keys.queue(MODEL, 1)) == 0


@pytest.mark.parametrize("counted", [99, -7, 0])
def test_reconcile_sets_the_counter_to_the_rows_in_the_streams(
        client: redis.Redis, keys: Keys, counted: int) -> None:
    admit(client, keys, 3, priority=1)
    admit(client, keys, 5, priority=3)
    client.set(keys.rows_waiting(MODEL), counted)
    assert reconciler(client, keys).run(0.0) == (counted, 8)
    assert rows(client, keys) == 8


def test_reconcile_zeroes_the_counter_of_empty_streams_and_creates_no_key(
        client: redis.Redis, keys: Keys) -> None:
    client.set(keys.rows_waiting(MODEL), 12)  # an increment whose entry Redis lost
    assert reconciler(client, keys).run(0.0) == (12, 0)
    assert rows(client, keys) == 0
    client.delete(keys.rows_waiting(MODEL))
    assert reconciler(client, keys).run(0.0) == (0, 0)
    assert not client.exists(keys.rows_waiting(MODEL))


def test_reconcile_bounds_the_counter_of_streams_too_large_to_read(
        client: redis.Redis, keys: Keys) -> None:
    width = SCAN_BYTES // 4 // 2 // 3 + 1  # two entries of 3 rows: past SCAN_BYTES
    admit(client, keys, 3, width)
    admit(client, keys, 3, width)
    client.set(keys.rows_waiting(MODEL), 1000)
    assert reconciler(client, keys, max_rows=8).run(0.0) == (1000, 16)  # 2 entries x 8 rows
    client.set(keys.rows_waiting(MODEL), -5)
    assert reconciler(client, keys, max_rows=8).run(0.0) == (-5, 2)  # one row each at least
    client.set(keys.rows_waiting(MODEL), 6)
    assert reconciler(client, keys, max_rows=8).run(0.0) == (6, 6)


def test_reconcile_runs_every_interval() -> None:
    unused = redis.Redis()  # never connects: the test only reads the schedule
    OPENED.append(unused)
    watch = RowsReconciler(unused, "k", ["s"], 8, interval_s=2.0)
    assert watch.due(100.0)
    watch._next = 102.0  # as run(100.0) leaves it
    assert not watch.due(101.9) and watch.due(102.0)
    watch.suspect("a test")
    assert watch.due(100.1)


def test_a_worker_corrects_a_drifted_counter_within_the_interval(echo_stack: Stack) -> None:
    r, key = echo_stack.redis(), f"{echo_stack.prefix}:{{echo}}:rows"
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                        "data": [1.0, 2.0, 3.0, 4.0]}]}
    r.set(key, 10**6)  # far above max_queue_rows, with nothing waiting
    drifted = httpx.post(f"{echo_stack.url}/v2/models/echo/infer", json=body)
    wait_for(lambda: int(r.get(key) or 0) == 0, RECONCILE_EVERY_S + 2, "the counter to heal")
    assert httpx.post(f"{echo_stack.url}/v2/models/echo/infer", json=body).status_code == 200
    assert drifted.status_code in (200, 503)


def test_a_restart_that_loses_data_is_reconciled_at_once(logdir: Path, keys: Keys) -> None:
    """A Redis restarted empty is noticed (a failed read, a lost consumer group) and the
    counter recomputed at the next step, not an interval later."""
    server = RedisServer(logdir)
    try:
        folder = TEST_MODELS / MODEL
        config = load_model_config(folder)
        streams = streams_on(server.url, keys)
        reclaimer = Reclaimer(streams._redis, keys, MODEL, streams, 5.0)
        loop = InferenceLoop(config, load_model(config, folder, "cpu"), streams, reclaimer,
                             SharedState(multiprocessing.get_context("spawn")), keys)
        assert isinstance(loop.reconciler, RowsReconciler)
        loop.reconciler.interval_s = 3600.0
        loop.step()  # reconciles once at the start, then only hourly
        server.stop()
        server.start()  # empty
        client = redis.Redis.from_url(server.url)
        client.set(keys.rows_waiting(MODEL), 40)  # a counter that outlived its entries
        for _ in range(3):
            try:
                loop.step()
            except (OSError, redis.RedisError):
                continue
            if rows(client, keys) == 0:
                break
        assert rows(client, keys) == 0
        client.close()
    finally:
        server.stop()


def test_the_worker_answers_a_held_entry_after_a_restart_without_going_negative(
        logdir: Path, keys: Keys) -> None:
    """An entry read before Redis restarted empty and answered after it releases nothing:
    its rows went with the restart."""
    server = RedisServer(logdir)
    try:
        client = redis.Redis.from_url(server.url)
        streams = streams_on(server.url, keys)
        admit(client, keys, 3)
        [held] = streams.read(10, None)
        server.stop()
        server.start()
        client.close()
        client = redis.Redis.from_url(server.url)
        admit(client, keys, 2)  # admitted after the restart
        with pytest.raises(OSError):
            streams.read(10, None)  # the old connection is gone: the worker retries
        assert streams.read(10, None) == []  # NOGROUP: the groups are created again
        assert [e.rows for e in streams.read(10, None)] == [2]
        streams.answer([(held, Reply(held.request.id))])
        streams.settle()
        assert rows(client, keys) == 2
        client.close()
    finally:
        server.stop()


def test_a_request_refused_noscript_after_its_deadline_is_not_admitted(
        redis_server: RedisServer, keys: Keys) -> None:
    """A restarted Redis answers NOSCRIPT; a request whose deadline passed meanwhile is not
    sent again, so it holds no rows of the queue."""
    async def main() -> None:
        dispatcher = Dispatcher(redis_server.url, keys)
        await dispatcher.start()
        try:
            while dispatcher._writer is None:
                await asyncio.sleep(0.01)
            await dispatcher.redis.script_flush()
            x = Tensor.from_array("x", np.zeros((3, 4), np.float32))
            sent = Request(dispatcher.new_id(), dispatcher.reply_key, 0, 0, 2, [x])
            admission = Admission(keys.queue(MODEL, 2), keys.rows_waiting(MODEL), 3, 100)
            with pytest.raises(DeadlineExceeded):
                await dispatcher.submit(admission, sent, 0)
            await dispatcher.redis.ping()  # after the NOSCRIPT reply (the links are FIFO)
            await asyncio.sleep(0.05)
            assert await dispatcher.redis.xlen(keys.queue(MODEL, 2)) == 0
            assert await dispatcher.redis.get(keys.rows_waiting(MODEL)) is None
        finally:
            await dispatcher.close()
    asyncio.run(main())
