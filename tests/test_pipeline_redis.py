"""The pipelined inference loop over real Redis streams (an accelerator's process runs it;
on this machine's CPU models it is chosen here by hand): every request is answered once,
acknowledged, and its rows released."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Iterator
from typing import cast

import numpy as np
import pytest
import redis

from batching.envelope import Reply, Request, Tensor
from batching.keys import Keys
from batching.repository_scan import load_model_config
from batching.resp import Address, Connection
from tests.conftest import TEST_MODELS
from tests.procs import RedisServer
from workers.backends import load_model
from workers.inference import InferenceLoop
from workers.recovery import Reclaimer
from workers.shared_state import SharedState
from workers.streams import ModelStreams

MODEL = "echo"
REPLY = "cv:reply:pipeline-test"


@pytest.fixture
def loop(redis_server: RedisServer, client: redis.Redis, keys: Keys) -> Iterator[InferenceLoop]:
    link = Connection(Address.from_url(redis_server.url), timeout_s=5.0)
    folder = TEST_MODELS / MODEL
    config = load_model_config(folder)
    streams = ModelStreams(client, link, keys.queues(MODEL, config.queue.priority_levels),
                           keys.stats(MODEL), keys.rows_waiting(MODEL), "pipelined",
                           suspects_key=keys.suspects(MODEL))
    streams.ensure_groups()
    yield InferenceLoop(config, load_model(config, folder, "cpu"), streams,
                        Reclaimer(client, keys, MODEL, streams, 5.0),
                        SharedState(multiprocessing.get_context("spawn")), keys, pipelined=True)
    link.close()


def test_every_request_is_answered_once_and_released(
        loop: InferenceLoop, client: redis.Redis, keys: Keys) -> None:
    sent = {}
    for i in range(40):
        x = Tensor.from_array("x", np.full((1, 4), i, np.float32))
        now_ms = int(time.time() * 1000)
        request = Request(uuid.uuid4().hex, REPLY, now_ms + 60_000, now_ms, 1, [x])
        client.xadd(keys.queue(MODEL, 1), {"d": request.encode(), "r": 1})
        client.incrby(keys.rows_waiting(MODEL), 1)
        sent[request.id] = i
    deadline = time.monotonic() + 30
    while int(client.get(keys.rows_waiting(MODEL)) or 0) or not loop.idle:
        assert time.monotonic() < deadline, "the loop did not finish"
        loop.step()
    loop.streams.settle()
    replies = [Reply.decode(cast(bytes, raw)) for raw in client.lrange(REPLY, 0, -1)]
    assert sorted(r.id for r in replies) == sorted(sent)
    assert all(r.ok for r in replies)
    assert client.xlen(keys.queue(MODEL, 1)) == 0
    client.delete(REPLY)


def test_the_mark_of_an_entry_that_ran_anyway_goes_with_its_answer(
        redis_server: RedisServer, client: redis.Redis, keys: Keys) -> None:
    """A client that left while its request ran: the worker answers it (nobody reads that)
    and removes its withdrawn mark, so the set each read fetches holds waiting entries only."""
    link = Connection(Address.from_url(redis_server.url), timeout_s=5.0)
    stream = keys.queue(MODEL, 1)
    streams = ModelStreams(client, link, [stream], keys.stats(MODEL), keys.rows_waiting(MODEL),
                           "marks", suspects_key=keys.suspects(MODEL),
                           withdrawn_key=keys.withdrawn(MODEL))
    streams.ensure_groups()
    try:
        now_ms = int(time.time() * 1000)
        x = Tensor.from_array("x", np.zeros((1, 4), np.float32))
        for _ in range(2):
            request = Request(uuid.uuid4().hex, REPLY, now_ms + 60_000, now_ms, 1, [x])
            client.xadd(stream, {"d": request.encode(), "r": 1})
        running, waiting = streams.read(2, None)
        for entry in (running, waiting):  # both clients leave; the first one's runs already
            client.zadd(keys.withdrawn(MODEL), {f"{stream} {entry.entry_id}": now_ms + 60_000})
        assert streams.read(1, None) == []  # fetches the marks
        assert set(streams.withdrawn) == {running.entry_id, waiting.entry_id}
        streams.answer([(running, Reply(running.request.id, [x], batch_rows=1))])
        streams.settle()
        marks = client.zrange(keys.withdrawn(MODEL), 0, -1)
        assert marks == [f"{stream} {waiting.entry_id}".encode()]
        assert set(streams.withdrawn) == {waiting.entry_id}
    finally:
        client.delete(REPLY)
        link.close()
