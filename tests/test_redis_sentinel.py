"""Redis Sentinel: the whole stack on ``redis+sentinel://``, its primary killed mid-load;
and the lean client's part on its own: a primary demoted to replica, sentinels gone.

A primary, a replica and three sentinels (tests/redis_topologies.py); the API, an
inference worker and a job worker pointed at the sentinels. Under a steady stream of
requests the primary is SIGKILLed: the sentinels promote the replica, and every process
follows it without a restart. Every request gets exactly one answer, its own (a result
or a 503 while no primary answers, never a hang), and a job running across the failover
ends with every row.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis

from batching.redis_primary import PrimaryLocator
from batching.redis_topology import parse_topology
from batching.resp import Connection, open_link
from tests.conftest import TEST_MODELS, Stack
from tests.jobs_stack import add_job_worker, result, rows, submit, watch
from tests.procs import RedisServer, free_port, wait_for
from tests.redis_topologies import SentinelSet

BEFORE = 80
"""Requests answered before the primary is killed."""
DURING = 320
"""Requests sent, at RATE a second, from a second before the kill on."""
AFTER = 40
"""Requests sent once the service answers again: all must succeed."""
RATE = 40.0
CONCURRENCY = 8
JOB_ROWS = 64
"""The ``slow`` model's job: 8 chunks of 8 rows, 0.6 s each, two at a time."""


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    started = SentinelSet(tmp_path / "redis")
    yield started
    started.stop()


def body(value: float) -> dict[str, object]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                        "data": [value, 1.0, 2.0, 3.0]}]}


async def send(client: httpx.AsyncClient, url: str, value: float) -> tuple[int, float]:
    """One request; its status and when it was answered. A 200 must carry its own input,
    doubled: no request gets another's answer."""
    response = await client.post(f"{url}/v2/models/echo/infer", json=body(value))
    if response.status_code == 200:
        assert response.json()["outputs"][0]["data"][0] == value * 2
    else:
        assert "error" in response.json()
    return response.status_code, time.monotonic()


async def load(url: str, start: int, count: int, rate: float | None) -> list[tuple[int, float]]:
    """``count`` requests (``rate`` a second, or as fast as CONCURRENCY allows)."""
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(i: int) -> tuple[int, float]:
            if rate is not None:
                await asyncio.sleep(i / rate)
            async with gate:
                return await send(client, url, float(start + i))
        return await asyncio.gather(*(one(i) for i in range(count)))


def test_the_stack_follows_a_failover_with_one_answer_per_request(
        sentinels: SentinelSet, logdir: Path) -> None:
    stack = Stack(sentinels.url, TEST_MODELS, logdir, extra_env={
        "CONVEYOR_MODELS": "echo,slow", "CONVEYOR_HEARTBEAT_STALE_S": "3"})
    try:
        url = stack.add_api()
        stack.add_worker()
        add_job_worker(stack)
        stack.wait_ready()
        pids = [p.pid for p in stack.workers] + [p.pid for p, _ in stack.apis]
        before = asyncio.run(load(url, 0, BEFORE, None))
        assert Counter(s for s, _ in before) == {200: BEFORE}
        job = submit(stack, rows(JOB_ROWS), model="slow")
        old = sentinels.primary()

        killed = 0.0

        async def fail_over() -> list[tuple[int, float]]:
            nonlocal killed
            during = asyncio.create_task(load(url, BEFORE, DURING, RATE))
            await asyncio.sleep(1.0)
            killed = time.monotonic()
            old.stop()  # SIGKILL: no goodbye to anyone
            return await during
        during = asyncio.run(fail_over())
        statuses = Counter(s for s, _ in during)
        assert set(statuses) <= {200, 503}, statuses
        assert sentinels.primary_port() != old.port
        refused = [t for s, t in during if s == 503]
        assert refused, statuses  # the kill was noticed at all
        back = [t for s, t in during if s == 200 and t > min(refused)]
        if not back:  # a slow host: the failover outlasted the load
            wait_for(lambda: httpx.post(f"{url}/v2/models/echo/infer", json=body(-1.0),
                                        timeout=30).status_code == 200, 30,
                     f"an answer after the failover\n{sentinels.logs()}", interval=0.2)
            back = [time.monotonic()]
        # The first answer can come before every heartbeat reached the new primary: the
        # service is back when it says it is ready.
        wait_for(lambda: httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200, 30,
                 "the API ready again after the failover", interval=0.2)
        after = asyncio.run(load(url, BEFORE + DURING, AFTER, None))
        assert Counter(s for s, _ in after) == {200: AFTER}
        final, _ = watch(stack, job, timeout=60)
        assert final["state"] == "SUCCEEDED", final
        y = result(stack, job)["y"]
        np.testing.assert_array_equal(y, rows(JOB_ROWS) * 2)
        assert all(p.alive() for p in stack.workers) and all(p.alive() for p, _ in stack.apis)
        assert pids == [p.pid for p in stack.workers] + [p.pid for p, _ in stack.apis]
        print(f"failover: first success {min(back) - killed:.1f}s after the kill; "
              f"answers during: {dict(statuses)}")
    finally:
        stack.stop()


@pytest.fixture
def demoted(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """Two servers: the first, once a primary, is made a replica of the second by the test."""
    folders = [tmp_path / "old", tmp_path / "new"]
    for folder in folders:
        folder.mkdir()
    old, new = (RedisServer(folder) for folder in folders)
    yield old, new
    old.stop()
    new.stop()


def test_a_demoted_primary_drops_the_lean_links_and_a_replica_is_refused(
        demoted: tuple[RedisServer, RedisServer]) -> None:
    old, new = demoted
    address = parse_topology(old.url).node
    link = Connection(address, 2.0)
    assert link.execute([("SET", "k", "1")]) == [b"OK"]

    async def open_async() -> bool:
        primary = await open_link(address, primary=True)
        primary.abort()
        return True
    assert asyncio.run(open_async())  # a primary: ROLE says master
    with redis.Redis(port=old.port) as client:
        client.replicaof("127.0.0.1", new.port)
    with pytest.raises(ConnectionError, match="replica now"):
        link.execute([("SET", "k", "2")])  # READONLY
    assert link._sock is None  # closed: the next command reconnects (and asks again)

    async def write_async() -> bool:
        lean = await open_link(address)
        with pytest.raises(ConnectionError, match="READONLY"):
            await lean.execute(("SET", "k", "3"))
        await asyncio.wait_for(lean.closed, 1)
        return lean.open
    assert asyncio.run(write_async()) is False
    with pytest.raises(ConnectionError, match="no primary"):
        asyncio.run(open_async())
    located = Connection(address, 2.0, locate=lambda: address)
    with pytest.raises(ConnectionError, match="no primary"):
        located.execute([("GET", "k")])


def test_no_sentinel_answering_is_a_connection_error_naming_each(tmp_path: Path) -> None:
    url = f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/mymaster/0"
    locator = PrimaryLocator(parse_topology(url))
    with pytest.raises(ConnectionError, match="no sentinel names the primary 'mymaster'"):
        locator.address()
    with pytest.raises(ConnectionError, match="no sentinel names the primary 'mymaster'"):
        asyncio.run(locator.address_async())
