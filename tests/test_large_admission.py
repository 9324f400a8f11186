"""A large request (an entry above LARGE_ENTRY_BYTES) is admitted without its bytes in a
Lua script: admit_rows.lua reserves its rows, then a plain XADD appends it (issue 37)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from api.admission import ADMIT_ROWS, LARGE_ENTRY_BYTES
from api.dispatch import Admission, Dispatcher
from batching.envelope import FIELD, Reply, Request, Tensor
from batching.errors import DeadlineExceeded, Overloaded
from batching.keys import Keys
from tests.dispatcher_run import run_dispatcher
from tests.procs import RedisServer
from workers.reconcile import RowsReconciler

KEYS = Keys("tla")
STREAM = KEYS.queue("m", 1)
ROWS = KEYS.rows_waiting("m")


def request(dispatcher: Dispatcher, rows: int = 1, width: int = LARGE_ENTRY_BYTES) -> Request:
    """``rows`` rows of ``width`` bytes: above LARGE_ENTRY_BYTES at the default width."""
    x = Tensor.from_array("x", np.ones((rows, width), np.uint8))
    now = int(time.time() * 1000)
    return Request(dispatcher.new_id(), dispatcher.reply_key, now + 5000, now, 1, [x])


async def serve_one(client: aioredis.Redis) -> Request:
    """Act as a worker: take the oldest entry and answer it."""
    deadline = time.monotonic() + 10
    while not (entries := await client.xrange(STREAM, count=1)):
        assert time.monotonic() < deadline, "no entry came"
        await asyncio.sleep(0.005)
    entry_id, fields = cast(tuple[bytes, dict[bytes, bytes]], entries[0])
    await client.xdel(STREAM, entry_id)
    sent = Request.decode(fields[FIELD])
    assert fields[b"r"] == str(sent.rows).encode()
    await client.rpush(sent.reply, Reply(sent.id, sent.inputs, batch_rows=sent.rows).encode())
    return sent


def calls(info: dict[str, Any], verb: str) -> int:
    return int(info.get(f"cmdstat_{verb}", {}).get("calls", 0))


@pytest.mark.parametrize("lean", [True, False])
def test_a_large_request_reaches_redis_in_no_script(redis_server: RedisServer,
                                                    lean: bool) -> None:
    """MONITOR shows every command, those a script calls too: the large request's bytes
    arrive in one XADD from the API's connection; the one script call is small."""
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        seen: list[dict[str, Any]] = []
        async with client.monitor() as monitor:
            sent = request(dispatcher, 2)
            small = request(dispatcher, 1, width=8)
            waiting = [asyncio.ensure_future(dispatcher.submit(
                Admission(STREAM, ROWS, r.rows, 100), r, 5)) for r in (sent, small)]
            deadline = time.monotonic() + 10
            while not any(c["command"].startswith("XADD") and c["client_type"] != "lua"
                          for c in seen):
                assert time.monotonic() < deadline, seen
                seen.append(await monitor.next_command())
        assert await client.get(ROWS) == b"3"
        served = {(await serve_one(client)).id for _ in range(2)}
        assert served == {sent.id, small.id}
        assert {r.id for r in await asyncio.gather(*waiting)} == {sent.id, small.id}
        scripts = [c for c in seen if c["command"].split(" ", 1)[0] in ("EVAL", "EVALSHA")]
        assert scripts and all(len(c["command"]) < 4 * LARGE_ENTRY_BYTES for c in scripts)
        large_adds = [c for c in seen if c["command"].startswith("XADD")
                      and len(c["command"]) > LARGE_ENTRY_BYTES]
        assert [c["client_type"] for c in large_adds] == ["tcp"]
    run_dispatcher(redis_server, KEYS, body, lean=lean)


def test_a_full_queue_refuses_a_large_request_without_writing(redis_server: RedisServer) -> None:
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        await client.set(ROWS, 99)
        with pytest.raises(Overloaded, match="99 rows waiting, limit 100"):
            await dispatcher.submit(Admission(STREAM, ROWS, 2, 100), request(dispatcher, 2), 5)
        assert await client.xlen(STREAM) == 0
        assert await client.get(ROWS) == b"99"
        sent = request(dispatcher, 1)  # one row still fits
        waiting = asyncio.ensure_future(dispatcher.submit(
            Admission(STREAM, ROWS, 1, 100), sent, 5))
        assert (await serve_one(client)).id == sent.id
        assert (await waiting).id == sent.id
        assert await client.get(ROWS) == b"100"
    run_dispatcher(redis_server, KEYS, body)


def test_a_counter_below_zero_still_admits_a_large_request(redis_server: RedisServer) -> None:
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        await client.set(ROWS, -5)
        sent = request(dispatcher)
        waiting = asyncio.ensure_future(dispatcher.submit(Admission(STREAM, ROWS, 1, 1), sent, 5))
        assert (await serve_one(client)).id == sent.id
        assert (await waiting).id == sent.id
    run_dispatcher(redis_server, KEYS, body)


def test_a_request_given_up_before_its_reservation_answered_is_never_appended(
        redis_server: RedisServer) -> None:
    """A timeout of 0 expires the request in the tick its reservation is sent: the rows
    come back off the counter and no entry is written."""
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        await client.config_resetstat()
        with pytest.raises(DeadlineExceeded):
            await dispatcher.submit(Admission(STREAM, ROWS, 3, 100), request(dispatcher, 3), 0)
        deadline = time.monotonic() + 10
        while calls(await client.info("commandstats"), "decrby") < 1:
            assert time.monotonic() < deadline, "the reserved rows were never given back"
            await asyncio.sleep(0.01)
        assert int(await client.get(ROWS) or 0) == 0
        assert await client.xlen(STREAM) == 0
    run_dispatcher(redis_server, KEYS, body)


def test_rows_reserved_by_an_api_that_died_before_appending_are_reconciled(
        client: redis.Redis, keys: Keys) -> None:
    rows_key, streams = keys.rows_waiting("m"), keys.queues("m", 3)
    assert client.eval(ADMIT_ROWS, 1, rows_key, 100, 4) == 4  # and no XADD after it
    assert RowsReconciler(client, rows_key, streams, 8).run(0.0) == (4, 0)
    assert int(client.get(rows_key) or 0) == 0


def test_the_large_requests_reserved_in_one_write_are_appended_in_one(
        redis_server: RedisServer) -> None:
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        writer = dispatcher._writer
        assert writer is not None
        prepared: list[list[str]] = []
        prepare = writer.prepare

        def recording(commands: Any) -> Any:
            prepared.append([str(c[0]) for c in commands])
            return prepare(commands)

        writer.prepare = recording  # type: ignore[method-assign]
        sent = [request(dispatcher) for _ in range(3)]
        waiting = [asyncio.ensure_future(dispatcher.submit(
            Admission(STREAM, ROWS, 1, 100), r, 5)) for r in sent]
        assert {(await serve_one(client)).id for _ in sent} == {r.id for r in sent}
        assert {r.id for r in await asyncio.gather(*waiting)} == {r.id for r in sent}
        assert prepared == [["EVAL"] * 3, ["XADD"] * 3]
    run_dispatcher(redis_server, KEYS, body)
