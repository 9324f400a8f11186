"""A process's death counts against the entries it may have died of, not against every
entry it held: a poison request reaches the dead-letter stream alone, its former
neighbours keep their deliveries and succeed (issue 10: one bad part stays alone)."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import pytest
import redis

from batching.envelope import Request, Tensor
from batching.former import Batch, Entry
from batching.keys import GROUP, Keys
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


@pytest.fixture
def streams_of(redis_server: RedisServer, keys: Keys) -> Iterator[Callable[[str], ModelStreams]]:
    opened: list[redis.Redis | Connection] = []

    def make(consumer: str) -> ModelStreams:
        client = redis.Redis.from_url(redis_server.url)
        link = Connection(Address.from_url(redis_server.url), timeout_s=5.0)
        opened.extend([client, link])
        streams = ModelStreams(client, link, keys.queues(MODEL, 2), keys.stats(MODEL),
                               keys.rows_waiting(MODEL), consumer,
                               suspects_key=keys.suspects(MODEL))
        streams.ensure_groups()
        return streams

    yield make
    for each in opened:
        each.close()


def admit(client: redis.Redis, keys: Keys, count: int) -> None:
    for _ in range(count):
        x = Tensor.from_array("x", np.zeros((1, 4), np.float32))
        request = Request(uuid.uuid4().hex, "cv:reply:test", 0, 0, 1, [x])
        client.xadd(keys.queue(MODEL, 1), {"d": request.encode(), "r": 1})


def by_id(entries: list[Entry]) -> dict[str, int]:
    return {e.entry_id: e.deliveries for e in entries}


def test_a_death_counts_only_against_the_entry_running_alone(
        client: redis.Redis, keys: Keys, streams_of: Callable[[str], ModelStreams]) -> None:
    admit(client, keys, 3)
    stream = keys.queue(MODEL, 1)
    first = streams_of("first").read(10, None)
    # Its first death: any of the three could have been in the batch that killed it.
    second = streams_of("second")
    held = second.claim_from(stream, "first", 10)
    assert by_id(held) == {e.entry_id: 2 for e in first}
    assert [e.entry_id for e in held] == [e.entry_id for e in first]  # stream order kept
    # The second dies running the middle one alone.
    second.on_trial(held[1])
    third = streams_of("third").claim_from(stream, "second", 10)
    assert by_id(third) == {held[0].entry_id: 2, held[1].entry_id: 3, held[2].entry_id: 2}
    # Redis's own count agrees, so a later claim starts from the right figure.
    pending = client.xpending_range(stream, GROUP, min="-", max="+", count=10)
    assert {cast(bytes, p["message_id"]).decode(): p["times_delivered"] for p in pending} == by_id(third)
    assert not client.exists(keys.suspects(MODEL))  # the record served once, and went


def test_a_death_with_nothing_on_trial_does_not_count_against_held_redeliveries(
        client: redis.Redis, keys: Keys, streams_of: Callable[[str], ModelStreams]) -> None:
    admit(client, keys, 2)
    stream = keys.queue(MODEL, 1)
    streams_of("first").read(10, None)
    held = streams_of("second").claim_from(stream, "first", 10)
    admit(client, keys, 1)
    fresh = streams_of("second").read(10, None)  # read, and perhaps running, at its death
    third = streams_of("third").claim_from(stream, "second", 10)
    assert by_id(third) == {**{e.entry_id: 2 for e in held}, fresh[0].entry_id: 2}


def test_the_loop_puts_a_redelivered_entry_on_trial_and_clears_it_with_the_answer(
        client: redis.Redis, keys: Keys, streams_of: Callable[[str], ModelStreams]) -> None:
    admit(client, keys, 1)
    stream = keys.queue(MODEL, 1)
    streams_of("first").read(10, None)
    streams = streams_of("second")
    [entry] = streams.claim_from(stream, "first", 10)
    folder = TEST_MODELS / MODEL
    config = load_model_config(folder)
    loop = InferenceLoop(config, load_model(config, folder, "cpu"), streams,
                         Reclaimer(client, keys, MODEL, streams, 5.0),
                         SharedState(multiprocessing.get_context("spawn")), keys)
    seen: list[bytes | str | None] = []
    predict = loop.model.predict

    def watched(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen.append(client.hget(keys.suspects(MODEL), "second"))
        return predict(inputs)

    loop.model.predict = watched  # type: ignore[method-assign]
    loop.run(Batch([entry], "test", loop.former.layout))
    streams.settle()
    assert seen == [f"{entry.stream} {entry.entry_id}".encode()]
    assert not client.exists(keys.suspects(MODEL))
    assert client.xlen(stream) == 0


def test_the_blame_names_the_stream_as_well_as_the_entry_id(
        client: redis.Redis, keys: Keys, streams_of: Callable[[str], ModelStreams]) -> None:
    """Entry ids of two priority streams may coincide: only the one on trial is blamed."""
    x = Tensor.from_array("x", np.zeros((1, 4), np.float32))
    for priority in (1, 2):
        request = Request(uuid.uuid4().hex, "cv:reply:test", 0, 0, priority, [x])
        client.xadd(keys.queue(MODEL, priority), {"d": request.encode(), "r": 1}, id="5-0")
    streams_of("first").read(10, None)
    second = streams_of("second")
    held = [e for level in (1, 2) for e in second.claim_from(keys.queue(MODEL, level), "first", 10)]
    assert [(e.entry_id, e.deliveries) for e in held] == [("5-0", 2), ("5-0", 2)]
    second.on_trial(held[1])  # the priority-2 entry
    third = streams_of("third")
    assert [e.deliveries for e in third.claim_from(keys.queue(MODEL, 1), "second", 10)] == [2]
    assert [e.deliveries for e in third.claim_from(keys.queue(MODEL, 2), "second", 10)] == [3]


def test_two_processes_claiming_a_dead_consumer_at_once_run_each_entry_once(
        client: redis.Redis, keys: Keys, streams_of: Callable[[str], ModelStreams],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both saw the dead consumer's entries pending; the one that claims second takes none
    (before, both took all of them, and each request ran twice)."""
    admit(client, keys, 3)
    stream = keys.queue(MODEL, 1)
    read = streams_of("dead").read(10, None)
    time.sleep(0.05)  # the entries idle a while, as a dead consumer's do
    late, early = streams_of("late"), streams_of("early")
    taken: list[Entry] = []
    seen = late._redis.xpending_range

    def pending_then_overtaken(*args: Any, **kwargs: Any) -> Any:
        pending = seen(*args, **kwargs)
        taken.extend(early.claim_from(stream, "dead", 10))  # between late's XPENDING and XCLAIM
        return pending

    monkeypatch.setattr(late._redis, "xpending_range", pending_then_overtaken)
    assert late.claim_from(stream, "dead", 10) == []
    assert [e.entry_id for e in taken] == [e.entry_id for e in read]
    held = client.xpending_range(stream, GROUP, min="-", max="+", count=10)
    assert {cast(bytes, p["consumer"]).decode() for p in held} == {"early"}
