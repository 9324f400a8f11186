"""``queue.partitions: 3`` through a real API, Redis and worker: every request answered,
the requests spread over the three partitions' streams, the depths summed, and a request
of a higher priority still served ahead of the lower-priority backlog in every partition.
An unload, a reclaim and the counters' reconciliation reach every partition."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import httpx
import numpy as np
import redis

from batching.envelope import Reply, Request, Tensor
from batching.keys import GROUP, Keys
from batching.redis_links import BlockingLink, blocking_link
from tests.conftest import TEST_MODELS, Stack
from tests.procs import RedisServer, wait_for
from workers.recovery import Reclaimer
from workers.streams import ModelStreams
from workers.unload import turn_away

MODEL = "hot"
CONFIG = """\
backend: python
max_batch_size: 2
inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
outputs:
  - {name: y, datatype: FP32, shape: [-1, 4]}
  - {name: batch_rows, datatype: INT64, shape: [-1, 1]}
batching: {max_queue_delay_us: 0, adaptive: false}
queue: {partitions: 3, priority_levels: 2, default_priority: 2}
parameters: {delay_ms: %d}
"""


def hot_stack(make_stack: Callable[..., Stack], root: Path, delay_ms: int, **env: str) -> Stack:
    folder = root / "models" / MODEL
    folder.mkdir(parents=True)
    shutil.copy(TEST_MODELS / "slow" / "model.py", folder / "model.py")
    (folder / "config.yaml").write_text(CONFIG % delay_ms)
    stack = make_stack(root / "models", **env)
    stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    return stack


def body(value: float, priority: int | None = None) -> dict[str, object]:
    parameters = {} if priority is None else {"priority": priority}
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                        "data": [value] * 4}], "parameters": parameters}


def test_every_request_is_answered_from_all_three_partitions(
        make_stack: Callable[..., Stack], tmp_path: Path) -> None:
    stack = hot_stack(make_stack, tmp_path, delay_ms=0)

    async def load() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            return await asyncio.gather(*(
                client.post(f"/v2/models/{MODEL}/infer", json=body(i)) for i in range(60)))
    for i, response in enumerate(asyncio.run(load())):
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["data"][0] == i * 2

    keys, client = Keys(stack.prefix), stack.redis()
    added = [int(client.xinfo_stream(keys.queue(MODEL, 2, p))["entries-added"])
             for p in range(3)]
    assert sum(added) == 60 and min(added) >= 15, added  # in turn, from one API process

    def drained() -> bool:
        depths = httpx.get(f"{stack.url}/v2/conveyor/queues", timeout=10).json()
        [model] = depths["models"]
        assert [(s["priority"], s["partition"]) for s in model["streams"]] == [
            (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
        return model["rows_waiting"] == 0 and not any(s["entries"] for s in model["streams"])
    wait_for(drained, 10, "every partition's rows released")
    metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
    assert f'model="{MODEL}"' in metrics


def test_a_higher_priority_request_goes_ahead_of_every_partitions_backlog(
        make_stack: Callable[..., Stack], tmp_path: Path) -> None:
    """48 priority-2 requests, two rows per batch, spread over the three partitions, wait
    while the model holds its first batch; a priority-1 request joins them. Once it is
    queued the model goes on: it runs after at most the held batch and the one the worker
    had already formed (4 rows), ahead of the rest of every partition's backlog. The model
    waits on a file, not a clock, so the order is the same on a busy host."""
    log = tmp_path / "executed.log"
    hold = Path(f"{log}.hold")
    stack = hot_stack(make_stack, tmp_path, delay_ms=10, ECHO_LOG=str(log))
    keys, client = Keys(stack.prefix), stack.redis()

    def added(level: int) -> int:
        return sum(int(client.xinfo_stream(keys.queue(MODEL, level, p))["entries-added"])
                   for p in range(3) if client.exists(keys.queue(MODEL, level, p)))

    def send(value: float, priority: int) -> int:
        response = httpx.post(f"{stack.url}/v2/models/{MODEL}/infer",
                              json=body(value, priority), timeout=60)
        return response.status_code

    hold.touch()
    try:
        with ThreadPoolExecutor(max_workers=49) as pool:
            backlog = [pool.submit(send, i, 2) for i in range(1, 49)]
            wait_for(lambda: added(2) == 48, 60, "the backlog queued")
            urgent = pool.submit(send, 1000, 1)
            wait_for(lambda: added(1) == 1, 60, "the priority-1 request queued")
            hold.unlink()
            assert urgent.result() == 200
            assert all(f.result() == 200 for f in backlog)
    finally:
        hold.unlink(missing_ok=True)
    ran = [float(v) for v in log.read_text().split()]
    assert sorted(ran) == [*range(1, 49), 1000], ran
    assert ran.index(1000) <= 4, ran


def test_an_unload_answers_what_waits_in_every_partition(redis_server: RedisServer) -> None:
    """turn_away, told the model's partitions, answers the unread requests of each with a
    404 and leaves every partition's counter at 0."""
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    parts = keys.partitions(MODEL, 2, 3)
    x = Tensor.from_array("x", np.zeros((1, 4), np.float32))
    for p, part in enumerate(parts):
        request = Request(f"r{p}", keys.reply("api"), int(time.time() * 1000) + 60_000, 0, 1,
                          [x])
        # Added a second before the unload (its id says when): answered, not left for
        # a serving process.
        client.xadd(part.streams[1], {"d": request.encode(), "r": 1},
                    id=f"{int(time.time() * 1000) - 1000}-{p}")
        client.incrby(part.rows, 1)
    client.hset(keys.repository(), MODEL, json.dumps({"state": "unloaded", "ts": 1.0}))
    for stream in (s for part in parts for s in part.streams):
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    assert turn_away(client, redis_server.url, keys, MODEL, 2, 3) == 3
    replies = [Reply.decode(b) for b in cast(list[bytes], client.lrange(keys.reply("api"), 0, -1))]
    assert sorted(r.id for r in replies) == ["r0", "r1", "r2"]
    assert all("was unloaded" in r.error for r in replies)
    assert [int(client.get(part.rows) or 0) for part in parts] == [0, 0, 0]
    client.close()



def partitioned_streams(url: str, keys: Keys, consumer: str,
                        opened: list[redis.Redis | BlockingLink]) -> ModelStreams:
    """An inference process's Redis side for MODEL with 3 partitions of 2 levels (its
    connections added to ``opened``)."""
    client, link = redis.Redis.from_url(url), blocking_link(url, 5.0)
    opened += [client, link]
    first, *more = keys.partitions(MODEL, 2, 3)
    streams = ModelStreams(client, link, list(first.streams), keys.stats(MODEL), first.rows,
                           consumer, suspects_key=keys.suspects(MODEL),
                           withdrawn_key=first.withdrawn, more=tuple(more))
    streams.ensure_groups()
    return streams


def test_a_dead_consumers_entries_are_claimed_and_counters_reconciled_per_partition(
        redis_server: RedisServer) -> None:
    """A consumer that read an entry of each partition and died: another claims all
    three. Each partition's counter, set wrong by hand, is recomputed from its own
    streams."""
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_server.url)
    opened: list[redis.Redis | BlockingLink] = [client]
    try:
        parts = keys.partitions(MODEL, 2, 3)
        x = Tensor.from_array("x", np.zeros((2, 4), np.float32))
        dead = partitioned_streams(redis_server.url, keys, "dead", opened)
        for p, part in enumerate(parts):
            request = Request(f"r{p}", keys.reply("api"), 0, 0, 2, [x])
            client.xadd(part.streams[1], {"d": request.encode(), "r": 2})
            client.set(part.rows, 2)
        read = sorted(e.stream for e in dead.read(10, None))
        assert read == sorted(p.streams[1] for p in parts)
        alive = partitioned_streams(redis_server.url, keys, "alive", opened)
        claimed = Reclaimer(client, keys, MODEL, alive, stale_s=5.0).poll(time.time(), 10)
        assert sorted(e.request.id for e in claimed) == ["r0", "r1", "r2"]

        for p, part in enumerate(parts):
            client.set(part.rows, 10 * p + 7)
        reconciler = alive.reconciler(max_entry_rows=2)
        assert reconciler.run(time.time()) == (7 + 17 + 27, 6)
        assert [int(client.get(part.rows) or 0) for part in parts] == [2, 2, 2]
    finally:
        for opening in opened:
            opening.close()
