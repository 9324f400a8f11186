"""Redis Sentinel: the whole stack on ``redis+sentinel://``, its primary killed mid-load.

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

from tests.conftest import TEST_MODELS, Stack
from tests.jobs_stack import add_job_worker, result, rows, submit, watch
from tests.redis_topologies import SentinelSet

BEFORE = 80
"""Requests answered before the primary is killed."""
DURING = 200
"""Requests sent, at RATE a second, from the kill on."""
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

        async def fail_over() -> list[tuple[int, float]]:
            during = asyncio.create_task(load(url, BEFORE, DURING, RATE))
            await asyncio.sleep(1.0)
            old.stop()  # SIGKILL: no goodbye to anyone
            return await during
        killed = time.monotonic() + 1.0
        during = asyncio.run(fail_over())
        statuses = Counter(s for s, _ in during)
        assert set(statuses) <= {200, 503}, statuses
        assert sentinels.primary_port() != old.port
        refused = [t for s, t in during if s == 503]
        assert refused, statuses  # the kill was noticed at all
        back = [t for s, t in during if s == 200 and t > min(refused)]
        assert back, f"no success after the failover: {statuses}\n{sentinels.logs()}"
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
