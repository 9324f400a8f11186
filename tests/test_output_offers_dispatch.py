"""The upload places of api/dispatch.py's requests (api/output_offers.py) against a real
redis-server, a test standing in for the worker: every place made is given up however its
request ends (answered with its outputs uploaded or in the reply, past its deadline, its
client gone, refused at admission, answered with a reference the API does not hold), and
a reply that names an upload for a request offered none is a 500, not empty outputs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import cast

import numpy as np
import pytest
import redis.asyncio as aioredis

from api.bytes_endpoint import BytesEndpoint
from api.dispatch import Admission, Dispatcher
from api.output_offers import OutputOffers
from api.output_upload import Uploads
from batching.config import ModelConfig, TensorSpec
from batching.envelope import FIELD, Reply, Request, Tensor
from batching.errors import ConveyorError, DeadlineExceeded, Overloaded
from batching.former import Entry
from batching.keys import Keys
from tests.bytes_endpoints import running_endpoint
from tests.procs import RedisServer
from workers.output_push import OutputPush

KEYS = Keys("to")
WIDTH = 4096
"""FP32 elements of a ``big`` output row: 16 KiB, above the smallest uploaded (1 KiB)."""
MODELS = {
    "big": ModelConfig(name="big", backend="python", max_batch_size=8,
                       inputs=(TensorSpec("x", "FP32", (-1, 2)),),
                       outputs=(TensorSpec("y", "FP32", (-1, WIDTH)),)),
    "small": ModelConfig(name="small", backend="python", max_batch_size=8,
                         inputs=(TensorSpec("x", "FP32", (-1, 2)),),
                         outputs=(TensorSpec("y", "FP32", (-1, 2)),)),
}
Body = Callable[[Dispatcher, aioredis.Redis, Uploads], Awaitable[None]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("offers"))
    yield server
    server.stop()


@pytest.fixture
def endpoint() -> Iterator[BytesEndpoint]:
    with running_endpoint() as started:
        yield started


def _run(server: RedisServer, endpoint: BytesEndpoint, body: Body) -> None:
    uploads = Uploads(1024)

    async def main() -> None:
        dispatcher = Dispatcher(server.url, KEYS)
        dispatcher.outputs = OutputOffers(uploads, endpoint, MODELS, lambda m: True, 1 << 20)
        client = aioredis.Redis.from_url(server.url)
        await client.flushdb()
        await dispatcher.start()
        try:
            while dispatcher._writer is None:
                await asyncio.sleep(0.01)
            await body(dispatcher, client, uploads)
        finally:
            await dispatcher.close()
            await client.aclose()
    asyncio.run(asyncio.wait_for(main(), 60))


def _request(dispatcher: Dispatcher, timeout_s: float = 30.0) -> Request:
    x = Tensor.from_array("x", np.zeros((1, 2), np.float32))
    now = int(time.time() * 1000)
    return Request(dispatcher.new_id(), dispatcher.reply_key, now + int(timeout_s * 1000), now,
                   1, [x])


def _admission(model: str, max_rows: int = 100) -> Admission:
    return Admission(KEYS.queue(model, 1), KEYS.rows_waiting(model), 1, max_rows, model)


async def _taken(client: aioredis.Redis, model: str) -> Request:
    """The oldest entry of ``model``'s stream, taken as a worker would."""
    stream = KEYS.queue(model, 1)
    while not (entries := await client.xrange(stream, count=1)):
        await asyncio.sleep(0.005)
    entry_id, fields = cast(tuple[bytes, dict[bytes, bytes]], entries[0])
    await client.xdel(stream, entry_id)
    return Request.decode(fields[FIELD])


async def _answer(client: aioredis.Redis, model: str, reply: Callable[[Request], Reply]) -> None:
    sent = await _taken(client, model)
    await client.rpush(sent.reply, reply(sent).encode())


def _output(sent: Request) -> Reply:
    row = np.arange(WIDTH, dtype=np.float32).reshape(1, WIDTH) + int(sent.id, 16)
    return Reply(sent.id, [Tensor.from_array("y", row)])


def test_every_request_s_place_is_given_up_however_it_ends(
        server: RedisServer, endpoint: BytesEndpoint) -> None:
    async def body(dispatcher: Dispatcher, client: aioredis.Redis, uploads: Uploads) -> None:
        push = OutputPush(5.0)

        def uploaded(sent: Request) -> Reply:
            reply = _output(sent)
            push.push([(Entry("s", "1-0", sent, 0.0), reply)])
            assert reply.outputs[0].ref is not None
            return reply

        for answer in (uploaded, _output):  # by reference, then in the reply itself
            request = _request(dispatcher)
            waiter = asyncio.ensure_future(dispatcher.submit(_admission("big"), request, 30))
            await _answer(client, "big", answer)
            got = await waiter
            assert got.outputs[0].raw == _output(request).outputs[0].raw
            assert len(uploads) == 0
        push.close()

        with pytest.raises(DeadlineExceeded):
            await dispatcher.submit(_admission("big"), _request(dispatcher, 0.2), 0.2)
        assert len(uploads) == 0
        await _taken(client, "big")

        waiter = asyncio.ensure_future(dispatcher.submit(_admission("big"), _request(dispatcher), 30))
        await _taken(client, "big")
        assert len(uploads) == 1
        waiter.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert len(uploads) == 0

        with pytest.raises(Overloaded):
            await dispatcher.submit(_admission("big", max_rows=0), _request(dispatcher), 30)
        assert len(uploads) == 0

        def forged(sent: Request) -> Reply:  # names an upload that never came
            return Reply(sent.id, [Tensor("y", "FP32", (1, WIDTH), b"", [1, 0, WIDTH * 4])])

        for model in ("big", "small"):  # "small": its request was offered no place at all
            waiter = asyncio.ensure_future(dispatcher.submit(_admission(model), _request(dispatcher), 30))
            await _answer(client, model, forged)
            with pytest.raises(ConveyorError) as caught:
                await waiter
            assert caught.value.code == "internal" and "does not hold" in caught.value.message
            assert len(uploads) == 0

    _run(server, endpoint, body)
