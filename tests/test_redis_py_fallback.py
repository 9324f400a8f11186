"""``CONVEYOR_LEAN_REDIS=0``: the hot path on redis-py answers requests as the lean client does.

The dispatcher (admission script, reply pops) and a worker's streams (XREADGROUP, the
answer write) run against a real redis-server, on either client; a thread stands in for
the inference loop. A real stack with the setting off answers over HTTP too.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import numpy as np
import pytest
import redis

from api.dispatch import Admission, Dispatcher
from batching.envelope import Reply, Request, Tensor
from batching.errors import Overloaded
from batching.keys import Keys
from batching.redis_links import blocking_link
from tests.conftest import MakeStack
from tests.procs import RedisServer
from workers.streams import ModelStreams

MODEL = "m"


def worker(url: str, keys: Keys, lean: bool, stop: threading.Event) -> threading.Thread:
    """A thread that answers every request with its own inputs, through ModelStreams."""
    client = redis.Redis.from_url(url)
    link = blocking_link(url, 5.0, lean)
    streams = ModelStreams(client, link, keys.queues(MODEL, 1), keys.stats(MODEL),
                           keys.rows_waiting(MODEL), "c1", suspects_key=keys.suspects(MODEL))
    streams.ensure_groups()

    def serve() -> None:
        try:
            while not stop.is_set():
                entries = streams.read(64, 50)
                streams.answer([(e, Reply(e.request.id, e.request.inputs,
                                          batch_rows=len(entries))) for e in entries])
            streams.settle()
        finally:
            link.close()
            client.close()

    thread = threading.Thread(target=serve, name="worker")
    thread.start()
    return thread


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "redis-py"])
def test_the_dispatcher_and_the_streams_answer_on_either_client(
        redis_server: RedisServer, lean: bool) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    stop = threading.Event()
    thread = worker(redis_server.url, keys, lean, stop)

    def request(dispatcher: Dispatcher, value: float) -> Request:
        x = Tensor.from_array("x", np.full((1, 2), value, np.float32))
        now = int(time.time() * 1000)
        return Request(dispatcher.new_id(), dispatcher.reply_key, now + 5000, now, 1, [x])

    async def main() -> None:
        dispatcher = Dispatcher(redis_server.url, keys, lean=lean)
        await dispatcher.start()
        try:
            for _ in range(500):
                if dispatcher._writer is not None:
                    break
                await asyncio.sleep(0.01)
            await dispatcher.redis.script_flush()  # the first admissions meet NOSCRIPT
            admission = Admission(keys.queue(MODEL, 1), keys.rows_waiting(MODEL), 1, 100)
            sent = [request(dispatcher, i) for i in range(20)]
            replies = await asyncio.gather(*(dispatcher.submit(admission, r, 5) for r in sent))
            assert [r.id for r in replies] == [s.id for s in sent]
            assert [float(r.outputs[0].array()[0, 0]) for r in replies] == list(range(20))
            full = Admission(admission.stream, admission.rows_key, 1, 0)
            with pytest.raises(Overloaded):
                await dispatcher.submit(full, request(dispatcher, 0), 5)
            assert await dispatcher.redis.get(keys.rows_waiting(MODEL)) == b"0"
        finally:
            await dispatcher.close()

    try:
        asyncio.run(main())
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()


def test_a_stack_with_the_lean_client_off_answers(make_stack: MakeStack) -> None:
    stack = make_stack(CONVEYOR_LEAN_REDIS="0", CONVEYOR_MODELS="echo")
    stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    response = httpx.post(f"{stack.url}/v2/models/echo/infer", timeout=30, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                    "data": x.ravel().tolist()}]})
    assert response.status_code == 200, response.text
    y = next(o for o in response.json()["outputs"] if o["name"] == "y")
    assert y["data"] == (2 * x).ravel().tolist()
