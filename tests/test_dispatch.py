"""The API's Redis side (batching.resp's Link, api.dispatch) against a real redis-server of its
own; a test stands in for the worker by popping the stream and pushing replies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.dispatch import ADMIT_CHUNK, REQUEST_ADMIT, Admission, Dispatcher
from batching.envelope import FIELD, Reply, Request, Tensor
from batching.errors import Overloaded, Unavailable
from batching.keys import Keys
from batching.resp import Address, RespError, open_link
from tests.dispatcher_run import run_dispatcher
from tests.procs import RedisServer, wait_for

KEYS = Keys("td")
STREAM = KEYS.queue("m", 1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("dispatch"))
    yield server
    server.stop()


def request(dispatcher: Dispatcher, rows: int = 1) -> Request:
    x = Tensor.from_array("x", np.zeros((rows, 2), np.float32))
    now = int(time.time() * 1000)
    return Request(dispatcher.new_id(), dispatcher.reply_key, now + 5000, now, 1, [x])


def admission(rows: int = 1, max_rows: int = 100) -> Admission:
    return Admission(STREAM, KEYS.rows_waiting("m"), rows, max_rows)


async def serve_one(client: aioredis.Redis, exec_ms: float = 0.0) -> Request:
    """Act as a worker: take the oldest entry and answer it (its model ran ``exec_ms``)."""
    while not (entries := await client.xrange(STREAM, count=1)):
        await asyncio.sleep(0.005)
    entry_id, fields = cast(tuple[bytes, dict[bytes, bytes]], entries[0])
    await client.xdel(STREAM, entry_id)
    sent = Request.decode(fields[FIELD])
    await client.rpush(sent.reply, Reply(sent.id, sent.inputs, batch_rows=sent.rows,
                                         exec_ms=exec_ms).encode())
    return sent


def test_link_pipelines_and_raises_error_replies(server: RedisServer) -> None:
    async def main() -> None:
        link = await open_link(Address.from_url(server.url))
        assert await link.execute(("SET", "k", "v"), ("GET", "k")) == [b"OK", b"v"]
        with pytest.raises(RespError, match="WRONGTYPE"):
            await link.execute(("LPUSH", "k", "x"))
        assert await link.execute(("PING",)) == [b"PONG"]
        link.abort()
        await link.closed
        with pytest.raises(ConnectionError):
            await link.execute(("PING",))
    asyncio.run(main())


def test_link_fails_pending_commands_when_the_connection_drops(server: RedisServer) -> None:
    async def main() -> None:
        link = await open_link(Address.from_url(server.url))
        pending = asyncio.ensure_future(link.execute(("BLPOP", "never", 5)))
        await asyncio.sleep(0.05)
        link.abort()
        with pytest.raises(ConnectionError):
            await pending
    asyncio.run(main())


def test_link_logs_in(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, "--requirepass", "s3cret")

    async def main() -> None:
        link = await open_link(Address.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/3"))
        await link.execute(("SET", "k", "v"))
        assert await link.execute(("SELECT", 3), ("GET", "k")) == [b"OK", b"v"]
        link.abort()
        with pytest.raises(RespError):
            await open_link(Address.from_url(f"redis://:wrong@127.0.0.1:{server.port}/0"))
    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_requests_are_admitted_and_answered_by_id(server: RedisServer) -> None:
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        first, second = request(dispatcher, 1), request(dispatcher, 3)
        waiting = [asyncio.ensure_future(dispatcher.submit(admission(r.rows), r, 5))
                   for r in (first, second)]
        await asyncio.sleep(0.05)
        assert int(cast(bytes, await client.get(KEYS.rows_waiting("m")))) == 4
        served = [await serve_one(client), await serve_one(client)]
        replies = await asyncio.gather(*waiting)
        assert [s.id for s in served] == [first.id, second.id]
        assert [r.id for r in replies] == [first.id, second.id]
        assert [r.batch_rows for r in replies] == [1, 3]
    run_dispatcher(server, KEYS, body)


def test_a_request_whose_client_left_within_its_tick_is_never_admitted(server: RedisServer) -> None:
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        named = Admission(STREAM, KEYS.rows_waiting("m"), 1, 100, "m")  # withdrawable
        warm = asyncio.ensure_future(dispatcher.submit(named, request(dispatcher), 5))
        await serve_one(client)  # the admission script is cached from here on
        await warm
        gone, kept = request(dispatcher), request(dispatcher)
        leaving = asyncio.ensure_future(dispatcher.submit(named, gone, 5))
        staying = asyncio.ensure_future(dispatcher.submit(named, kept, 5))
        await asyncio.sleep(0)  # both wait in this tick's write
        leaving.cancel()
        assert (await serve_one(client)).id == kept.id
        assert (await staying).id == kept.id
        assert leaving.cancelled()
        await asyncio.sleep(0.05)
        assert await client.xlen(STREAM) == 0
        assert int(cast(bytes, await client.get(KEYS.rows_waiting("m")))) == 2  # warm's, kept's
        assert await client.hget(KEYS.stats("m"), "withdrawn_count") is None  # nothing to undo
    run_dispatcher(server, KEYS, body)


def test_a_tick_of_many_requests_is_written_in_chunks(server: RedisServer) -> None:
    """The first ADMIT_CHUNK requests of a tick reach Redis before the tick's last one is
    submitted, so a worker can start on them while the API parses the rest."""
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        writes: list[int] = []
        flush = dispatcher._flush

        def counting() -> None:
            if dispatcher._outbox:
                writes.append(len(dispatcher._outbox))  # the requests this write takes
            flush()

        dispatcher._flush = counting  # type: ignore[method-assign]
        sent = [request(dispatcher) for _ in range(2 * ADMIT_CHUNK + 8)]
        waiting = [asyncio.ensure_future(dispatcher.submit(admission(), r, 5)) for r in sent]
        await asyncio.sleep(0)  # every submit runs in this one tick
        assert writes == [ADMIT_CHUNK, ADMIT_CHUNK]  # within the tick
        await asyncio.sleep(0)
        assert writes == [ADMIT_CHUNK, ADMIT_CHUNK, 8]  # the rest at its end
        served = [await serve_one(client) for _ in sent]
        assert [s.id for s in served] == [r.id for r in sent]
        assert [r.id for r in await asyncio.gather(*waiting)] == [r.id for r in sent]
    run_dispatcher(server, KEYS, body)


async def ids_in(client: aioredis.Redis, stream: str) -> list[str]:
    """The request ids of ``stream``'s entries, oldest first."""
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await client.xrange(stream))
    return [Request.decode(fields[FIELD]).id for _, fields in entries]


async def stream_holds(client: aioredis.Redis, stream: str, count: int) -> None:
    for _ in range(500):
        if await client.xlen(stream) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{stream} never held {count} entries")


def admission_calls(info: dict[str, Any]) -> int:
    return sum(int(info.get(f"cmdstat_{verb}", {}).get("calls", 0)) for verb in ("evalsha", "eval"))


def test_a_write_admits_each_streams_requests_in_one_script_call(server: RedisServer) -> None:
    """Twelve requests of one tick for two priority levels: two script calls, one per
    stream, each request in its stream in the order submitted."""
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        other = KEYS.queue("m", 2)
        await client.config_resetstat()
        before = admission_calls(await client.info("commandstats"))
        sent = [request(dispatcher) for _ in range(12)]
        streams = [STREAM if i % 3 else other for i in range(12)]
        waiting = [asyncio.ensure_future(dispatcher.submit(
            Admission(stream, KEYS.rows_waiting("m"), 1, 100), r, 5))
            for r, stream in zip(sent, streams, strict=True)]
        await stream_holds(client, STREAM, 8)
        await stream_holds(client, other, 4)
        assert admission_calls(await client.info("commandstats")) - before == 2
        for stream in (STREAM, other):
            assert await ids_in(client, stream) == [
                r.id for r, s in zip(sent, streams, strict=True) if s == stream]
        assert await client.get(KEYS.rows_waiting("m")) == b"12"
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    run_dispatcher(server, KEYS, body)


def test_within_one_call_each_request_is_held_to_the_rows_admitted_before_it(
        server: RedisServer) -> None:
    """Rows 2, 2, 1, 1 against a limit of 4 with 1 waiting: the first fits (3), the second
    would not (5), the third does (4), the fourth would not (5), as one call each would."""
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        await client.set(KEYS.rows_waiting("m"), 1)
        sizes = [2, 2, 1, 1]
        sent = [request(dispatcher, rows) for rows in sizes]
        waiting = [asyncio.ensure_future(dispatcher.submit(admission(rows, 4), r, 5))
                   for r, rows in zip(sent, sizes, strict=True)]
        await asyncio.wait([waiting[1], waiting[3]], timeout=5)
        with pytest.raises(Overloaded, match="3 rows waiting, limit 4"):
            waiting[1].result()
        with pytest.raises(Overloaded, match="4 rows waiting, limit 4"):
            waiting[3].result()
        assert await ids_in(client, STREAM) == [sent[0].id, sent[2].id]
        assert await client.get(KEYS.rows_waiting("m")) == b"4"
        for task in (waiting[0], waiting[2]):
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    run_dispatcher(server, KEYS, body)


def test_a_full_queue_is_refused_without_writing(server: RedisServer) -> None:
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        await client.set(KEYS.rows_waiting("m"), 99)
        with pytest.raises(Overloaded, match="99 rows waiting, limit 100"):
            await dispatcher.submit(admission(2, 100), request(dispatcher, 2), 5)
        assert await client.xlen(STREAM) == 0
    run_dispatcher(server, KEYS, body)


def test_a_counter_below_zero_still_admits(server: RedisServer) -> None:
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        await client.set(KEYS.rows_waiting("m"), -5)  # its key lost, then rows released
        sent = request(dispatcher)
        waiting = asyncio.ensure_future(dispatcher.submit(admission(), sent, 5))
        assert (await serve_one(client)).id == sent.id
        assert (await waiting).id == sent.id  # not a queue-full error for a queued request
    run_dispatcher(server, KEYS, body)


def test_a_flushed_script_cache_is_refilled(server: RedisServer) -> None:
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        await client.script_flush()
        sent = request(dispatcher)
        waiting = asyncio.ensure_future(dispatcher.submit(admission(), sent, 5))
        assert (await serve_one(client)).id == sent.id
        assert (await waiting).id == sent.id
        assert (await client.script_exists(REQUEST_ADMIT.sha)) == [True]
    run_dispatcher(server, KEYS, body)


def test_a_lone_request_is_marked_and_polled_for(server: RedisServer) -> None:
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        waiting = [asyncio.ensure_future(dispatcher.submit(admission(), request(dispatcher), 5))]
        await asyncio.sleep(0.005)
        assert dispatcher._lone.polling
        waiting.append(asyncio.ensure_future(dispatcher.submit(admission(), request(dispatcher), 5)))
        served = [await serve_one(client), await serve_one(client)]
        await asyncio.gather(*waiting)
        assert [s.params.get("lone") for s in served] == [1, None]
        await asyncio.sleep(0.01)
        assert not dispatcher._lone.polling  # nothing in flight: the loop sleeps again
    run_dispatcher(server, KEYS, body, busy_poll_s=1.0)


def test_the_poll_waits_out_most_of_a_slow_models_run(server: RedisServer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone request to a model that runs 200 ms is not polled for while it runs (the poll
    would take a core from the model); one to a model with no record is polled for at once."""
    yields = [0]
    monkeypatch.setattr("api.dispatch.os.sched_yield", lambda: yields.__setitem__(0, yields[0] + 1))

    async def lone_request(dispatcher: Dispatcher, client: aioredis.Redis) -> int:
        yields[0] = 0
        waiting = asyncio.ensure_future(dispatcher.submit(admission(), request(dispatcher), 5))
        await asyncio.sleep(0.05)
        polled = yields[0]
        await serve_one(client, exec_ms=200.0)
        await waiting
        return polled

    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        assert await lone_request(dispatcher, client) > 0  # no record yet: polled at once
        assert await lone_request(dispatcher, client) == 0  # 200 ms models: not yet
    run_dispatcher(server, KEYS, body, busy_poll_s=1.0)


def test_a_fast_models_lone_request_is_polled_for_even_after_a_slow_ones(
        server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slow model's delayed poll start, still pending when its request was answered,
    neither blocks nor stands in for the poll of the next lone request."""
    yields = [0]
    monkeypatch.setattr("api.dispatch.os.sched_yield", lambda: yields.__setitem__(0, yields[0] + 1))
    fast = Admission(STREAM, KEYS.rows_waiting("fast"), 1, 100)

    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        waiting = asyncio.ensure_future(dispatcher.submit(admission(), request(dispatcher), 5))
        await serve_one(client, exec_ms=500.0)  # the slow model: its next poll waits 400 ms
        await waiting
        waiting = asyncio.ensure_future(dispatcher.submit(admission(), request(dispatcher), 5))
        await serve_one(client, exec_ms=500.0)  # answered before its poll began
        await waiting
        yields[0] = 0
        waiting = asyncio.ensure_future(dispatcher.submit(fast, request(dispatcher), 5))
        await asyncio.sleep(0.05)
        assert yields[0] > 0  # polled at once, not 400 ms later
        await serve_one(client)
        await waiting
    run_dispatcher(server, KEYS, body, busy_poll_s=1.0)


def test_without_busy_polling_a_lone_request_is_marked_and_not_polled_for(
        server: RedisServer) -> None:
    """The mark also gives the request every core in the worker (CONVEYOR_LONE_ALL_CORES),
    which does not depend on polling."""
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        waiting = asyncio.ensure_future(dispatcher.submit(admission(), request(dispatcher), 5))
        await asyncio.sleep(0.005)
        assert not dispatcher._lone.polling
        assert (await serve_one(client)).params.get("lone") == 1
        await waiting
    run_dispatcher(server, KEYS, body)


def test_losing_redis_fails_waiting_requests_then_reconnects(server: RedisServer) -> None:
    async def body(dispatcher: Dispatcher, client: aioredis.Redis) -> None:
        waiting = asyncio.ensure_future(dispatcher.submit(admission(), request(dispatcher), 30))
        await asyncio.sleep(0.05)
        server.stop()
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await waiting
        assert time.monotonic() - started < 1  # at once, not at the deadline
        with pytest.raises(Unavailable):
            await dispatcher.submit(admission(), request(dispatcher), 5)
        server.start()
        await asyncio.to_thread(wait_for, lambda: dispatcher.redis_ok, 10, "the links again")
        sent = request(dispatcher)
        again = asyncio.ensure_future(dispatcher.submit(admission(), sent, 5))
        fresh = aioredis.Redis.from_url(server.url)
        assert (await serve_one(fresh)).id == sent.id
        assert (await again).id == sent.id
        await fresh.aclose()
    run_dispatcher(server, KEYS, body)


def test_a_redis_client_that_fails_to_close_does_not_stop_the_shutdown(
        server: RedisServer) -> None:
    async def main() -> None:
        dispatcher = Dispatcher(server.url, KEYS)
        await dispatcher.start()

        async def timed_out(close_connection_pool: bool | None = None) -> None:
            raise RedisTimeoutError("Timed out closing connection after 0.5")

        dispatcher._redis.aclose = timed_out  # type: ignore[method-assign]
        await dispatcher.close()  # logged, not raised
    asyncio.run(main())
