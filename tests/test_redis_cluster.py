"""Redis Cluster: three primaries (tests/redis_topologies.py), the stack on
``redis+cluster://`` with Celery on a plain Redis of its own.

Three models are placed so that their hash tags land on three different nodes: requests,
a job and a model's failure each cross the slots of the cluster. The lean client's
routing is tested on its own too: a stale slot map (``MOVED``) and a slot being migrated
(``ASK``). An inference process's answer, whose replies go to another node than its
releases, releases its entries only once the replies are pushed, on either client.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httpx
import numpy as np
import pytest
import redis

from api.dispatch import Admission, Dispatcher
from batching.envelope import Reply, Request, Tensor
from batching.keys import GROUP, Keys
from batching.redis_links import PipelineLink, blocking_link, link_opener
from batching.redis_topology import async_redis, parse_topology, sync_redis
from batching.resp_cluster import ClusterConnection, ClusterLink, key_slot
from tests.conftest import Stack
from tests.jobs_stack import PICKY, PICKY_CONFIG, add_job_worker, result, rows, submit, watch
from tests.procs import RedisServer
from tests.redis_topologies import ClusterSet
from workers.streams import ModelStreams

CANDIDATES = [f"m{i}" for i in range(100)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterSet]:
    started = ClusterSet(tmp_path_factory.mktemp("cluster"))
    yield started
    started.stop()


def one_model_per_node(cluster: ClusterSet) -> list[str]:
    """A model name whose hash tag lands on each node, in the nodes' order."""
    chosen: dict[int, str] = {}
    for name in CANDIDATES:
        chosen.setdefault(cluster.port_of_slot(key_slot(name)), name)
    return [chosen[server.port] for server in cluster.servers]


def body(value: float) -> dict[str, object]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                        "data": [value, 1.0, 2.0, 3.0]}]}


def test_the_stack_serves_models_on_three_nodes(cluster: ClusterSet, redis_server: RedisServer,
                                               logdir: Path, tmp_path: Path) -> None:
    models = one_model_per_node(cluster)
    ports = {cluster.port_of_slot(key_slot(m)) for m in models}
    assert len(ports) == 3, (models, ports)
    repository = tmp_path / "models"
    for name in models:
        (repository / name).mkdir(parents=True)
        (repository / name / "model.py").write_text(PICKY)
        (repository / name / "config.yaml").write_text(PICKY_CONFIG)
    stack = Stack(cluster.url, repository, logdir, extra_env={
        "CONVEYOR_CELERY_BROKER_URL": redis_server.url, "CONVEYOR_API_WORKERS": "2"})
    try:
        url = stack.add_api()
        stack.add_worker()
        add_job_worker(stack)
        stack.wait_ready()

        async def load() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                return await asyncio.gather(*(
                    client.post(f"{url}/v2/models/{models[i % 3]}/infer", json=body(i))
                    for i in range(60)))
        answers = asyncio.run(load())
        for i, response in enumerate(answers):
            assert response.status_code == 200, response.text
            assert response.json()["outputs"][0]["data"][0] == i * 2
        refused = httpx.post(f"{url}/v2/models/{models[1]}/infer", json=body(-1), timeout=30)
        assert refused.status_code == 500
        assert "negative row [-1.0" in refused.json()["error"]
        job = submit(stack, rows(40), model=models[2])
        final, _ = watch(stack, job, timeout=60)
        assert final["state"] == "SUCCEEDED", final
        np.testing.assert_array_equal(result(stack, job)["y"], rows(40) * 2)
        stats = httpx.get(f"{url}/v2/models/stats", timeout=10).json()["model_stats"]
        counted = {s["name"]: s["inference_stats"]["success"]["count"] for s in stats}
        assert all(counted[m] >= 20 for m in models), counted
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        for node in cluster.servers:  # each node holds its model's stream
            with redis.Redis(port=node.port) as client:
                held = {k.decode().split("{")[1].split("}")[0]
                        for k in client.keys(f"{stack.prefix}:*:q:*")}
            assert held == {models[cluster.servers.index(node)]}, held
    finally:
        stack.stop()


def test_the_lean_client_follows_moved_and_ask(cluster: ClusterSet) -> None:
    link = blocking_link(cluster.url, 2.0)
    assert isinstance(link, ClusterConnection)
    key_a, key_b = (f"{{{m}}}k" for m in one_model_per_node(cluster)[:2])
    link.execute([("SET", key_a, "1"), ("SET", key_b, "2")])
    node_a = link.routes.slots[key_slot(key_a)]
    node_b = link.routes.slots[key_slot(key_b)]
    assert node_a is not None and node_b is not None and node_a != node_b

    def swapped(slot: int) -> tuple[str, int]:
        """A stale map: key_a's slot on key_b's node and the other way round."""
        return node_b if slot == key_slot(key_a) else node_a
    for slot in range(16384):
        link.routes.slots[slot] = swapped(slot)
    assert link.execute([("GET", key_a), ("GET", key_b)]) == [b"1", b"2"]  # MOVED, twice
    link.close()

    key = "{asked}k"
    slot = key_slot(key)
    source = cluster.port_of_slot(slot)
    target = next(s.port for s in cluster.servers if s.port != source)
    with redis.Redis(port=source) as src, redis.Redis(port=target) as dst:
        source_id, target_id = src.cluster("MYID"), dst.cluster("MYID")
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        try:
            link = blocking_link(cluster.url, 2.0)
            assert link.execute([("SET", key, "there")]) == [b"OK"]  # ASK, then ASKING
            with pytest.raises(redis.exceptions.AskError):  # not on the source
                src.execute_command("GET", key)
            assert asked(dst, "GET", key) == b"there"
            link.close()

            async def through_the_api_link() -> list[object]:
                client = async_redis(cluster.url)
                api_link = await link_opener(cluster.url, client)()
                assert isinstance(api_link, ClusterLink)
                got = await api_link.execute(("GET", key), ("GET", key_a), ("GET", key_b))
                for slot in range(16384):  # stale again: MOVED, followed by the API's link
                    api_link.routes.slots[slot] = swapped(slot)
                got += await api_link.execute(("GET", key_a), ("GET", key_b))
                api_link.abort()
                await client.aclose()
                return list(got)
            assert asyncio.run(through_the_api_link()) == [b"there", b"1", b"2", b"1", b"2"]
        finally:
            asked(dst, "DEL", key)
            for node in (src, dst):
                node.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
    assert parse_topology(cluster.url).kind == "cluster"


def asked(node: redis.Redis, *command: object) -> object:
    """``command`` on a node importing its slot: after ``ASKING``, on the same connection."""
    pipe = node.pipeline(transaction=False)
    pipe.execute_command("ASKING")  # type: ignore[no-untyped-call]
    pipe.execute_command(*command)  # type: ignore[no-untyped-call]
    return pipe.execute()[1]


def test_the_redis_py_hot_path_routes_by_slot_too(cluster: ClusterSet) -> None:
    """``CONVEYOR_LEAN_REDIS=0``: the same commands on redis-py's cluster pipelines."""
    key_a, key_b = (f"{{{m}}}py" for m in one_model_per_node(cluster)[:2])
    link = blocking_link(cluster.url, 2.0, lean=False)
    try:
        replies = link.execute([("RPUSH", key_a, "1"), ("RPUSH", key_b, "2"),
                                ("EVAL", "return redis.call('LLEN', KEYS[1])", 1, key_b)])
        assert replies == [1, 1, 1]
    finally:
        link.close()

    async def through_the_api_link() -> list[object]:
        client = async_redis(cluster.url)
        api_link = await link_opener(cluster.url, client, lean=False)()
        assert isinstance(api_link, PipelineLink)
        got = await api_link.execute(("LPOP", key_a), ("BLMPOP", 1, 1, key_b, "LEFT", "COUNT", 9))
        api_link.abort()
        await client.aclose()
        return list(got)
    assert asyncio.run(through_the_api_link()) == [b"1", [key_b.encode(), [b"2"]]]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "redis-py"])
def test_an_answer_releases_its_entries_only_once_its_replies_are_pushed(
        cluster: ClusterSet, lean: bool) -> None:
    """The reply list lives on another node than the model's streams. While it refuses the
    push (a string where the list should be: ``WRONGTYPE``), an answer leaves its entries
    pending, in the stream and counted against the queue limit, for the reclaimer to re-run;
    once it takes the push, the same answer delivers the replies and releases the entries."""
    model, api, _ = one_model_per_node(cluster)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    stream, rows_key, reply_key = keys.queue(model, 1), keys.rows_waiting(model), keys.reply(api)
    assert (cluster.port_of_slot(key_slot(reply_key))
            != cluster.port_of_slot(key_slot(stream)))
    client = sync_redis(cluster.url)
    link = blocking_link(cluster.url, 2.0, lean)
    streams = ModelStreams(client, link, [stream], keys.stats(model), rows_key, "c1",
                           suspects_key=keys.suspects(model))
    try:
        streams.ensure_groups()
        for i in range(2):
            x = Tensor.from_array("x", np.zeros((2, 4), np.float32))
            request = Request(f"r{i}", reply_key, 0, 0, 1, [x])
            client.xadd(stream, {"d": request.encode(), "r": 2})
            client.incrby(rows_key, 2)
        entries = streams.read(10, None)
        assert [e.request.id for e in entries] == ["r0", "r1"]
        answered = [(e, Reply(e.request.id)) for e in entries]

        client.set(reply_key, "not a list")
        streams.answer(answered, {"success_count": 2})
        streams.settle()
        assert client.xpending(stream, GROUP)["pending"] == 2
        assert client.xlen(stream) == 2
        assert int(client.get(rows_key) or 0) == 4

        client.delete(reply_key)
        streams.answer(answered, {"success_count": 2})
        streams.settle()
        pushed = cast(list[bytes], client.lrange(reply_key, 0, -1))
        assert [Reply.decode(b).id for b in pushed] == ["r0", "r1"]
        assert client.xpending(stream, GROUP)["pending"] == 0
        assert client.xlen(stream) == 0
        assert int(client.get(rows_key) or 0) == 0
        # The run whose replies were refused counts too: the statistics went with them.
        assert int(client.hget(keys.stats(model), "success_count") or 0) == 4
    finally:
        link.close()
        for key in (stream, rows_key, reply_key, keys.stats(model)):
            client.delete(key)
        client.close()


REPLY_COMMANDS = {"rpush", "expire", "blmpop"}
"""The reply lists' commands: each list lives on its API process's slot, not the model's."""
NOT_DATA = {"info", "cluster", "ping", "hello", "client", "command", "auth", "select",
            "asking", "config"}


def partitioned_model(cluster: ClusterSet, partitions: int) -> str:
    """A model name whose first three partitions land on the three nodes, one each."""
    keys = Keys()
    for name in CANDIDATES:
        ports = {cluster.port_of_slot(key_slot(keys.rows_waiting(name, p)))
                 for p in range(partitions)}
        if len(ports) == 3:
            return name
    raise AssertionError("no candidate's partitions land on all three nodes")


def model_commands(cluster: ClusterSet) -> list[int]:
    """Each node's calls so far (INFO commandstats), its reply lists' and admin aside."""
    counted = []
    for server in cluster.servers:
        with redis.Redis(port=server.port) as node:
            stats = node.info("commandstats")
        counted.append(sum(int(s["calls"]) for name, s in stats.items()
                           if name.removeprefix("cmdstat_").split("|")[0] not in
                           REPLY_COMMANDS | NOT_DATA))
    return counted


def test_one_model_of_three_partitions_spreads_its_commands_over_three_nodes(
        cluster: ClusterSet, redis_server: RedisServer, logdir: Path, tmp_path: Path) -> None:
    """``queue.partitions: 3``, the partitions' tags on three nodes: under a few seconds of
    load each node carries its third of the model's commands, within 20%. Counted: every
    call a node ran (a script's own calls too), but the reply lists' (on the API process's
    slot) and the admin commands. Partition 0's node also holds the stats hash, which an
    inference process of a partitioned model writes twice a second, not with every batch."""
    model = partitioned_model(cluster, 3)
    folder = tmp_path / "models" / model
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(PICKY)
    (folder / "config.yaml").write_text(PICKY_CONFIG + "queue: {partitions: 3}\n"
                                        "batching: {overload: fifo}\n")  # every request served
    stack = Stack(cluster.url, tmp_path / "models", logdir,
                  extra_env={"CONVEYOR_CELERY_BROKER_URL": redis_server.url})
    try:
        url = stack.add_api()
        stack.add_worker()
        stack.wait_ready()
        before = model_commands(cluster)

        async def load() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                gate = asyncio.Semaphore(24)

                async def one(i: int) -> httpx.Response:
                    async with gate:
                        return await client.post(f"{url}/v2/models/{model}/infer", json=body(i))
                return await asyncio.gather(*(one(i) for i in range(900)))
        for i, response in enumerate(asyncio.run(load())):
            assert response.status_code == 200, response.text
            assert response.json()["outputs"][0]["data"][0] == i * 2
        spent = [after - b for after, b in zip(model_commands(cluster), before, strict=True)]
        mean = sum(spent) / 3
        assert all(abs(n - mean) <= 0.2 * mean for n in spent), spent
        depths = httpx.get(f"{url}/v2/conveyor/queues", timeout=10).json()["models"]
        assert len(depths[0]["streams"]) == 9  # each partition's streams, on its node
        assert f'model="{model}"' in httpx.get(f"{url}/metrics", timeout=10).text
        keys = Keys(stack.prefix)
        for part in range(3):  # in turn, from one API process (priority 2, the default)
            stream = keys.queue(model, 2, part)
            with redis.Redis(port=cluster.port_of_slot(key_slot(stream))) as node:
                assert int(node.xinfo_stream(stream)["entries-added"]) == 300
    finally:
        stack.stop()


def test_a_request_withdrawn_from_another_partition_is_counted_on_the_model(
        cluster: ClusterSet) -> None:
    """A request of partition 1 (another node than the model's stats hash) whose client
    leaves once it is queued: deleted, its rows released on partition 1's counter, and
    counted in the model's stats hash by a command of its own (one script over both
    slots would be refused: ``CROSSSLOT``)."""
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    model = partitioned_model(cluster, 3)
    part = keys.partition(model, 1, 1)

    async def main() -> None:
        dispatcher = Dispatcher(cluster.url, keys)
        client = async_redis(cluster.url)
        await dispatcher.start()
        try:
            deadline = time.monotonic() + 10
            while dispatcher._writer is None:  # linked to Redis
                assert time.monotonic() < deadline, "never linked"
                await asyncio.sleep(0.01)
            now = int(time.time() * 1000)
            x = Tensor.from_array("x", np.zeros((2, 4), np.float32))
            sent = Request(dispatcher.new_id(), dispatcher.reply_key, now + 5000, now, 1, [x])
            admission = Admission(part.streams[0], part.rows, 2, 100, model, 1)
            waiting = asyncio.ensure_future(dispatcher.submit(admission, sent, 5))
            while not await client.xlen(part.streams[0]):
                assert time.monotonic() < deadline, "never admitted"
                await asyncio.sleep(0.01)
            waiting.cancel()
            while await client.hget(keys.stats(model), "withdrawn_count") != b"1":
                assert time.monotonic() < deadline, "never counted"
                await asyncio.sleep(0.01)
            assert await client.xlen(part.streams[0]) == 0
            assert await client.get(part.rows) == b"0"
        finally:
            await dispatcher.close()
            await client.aclose()
    asyncio.run(main())
