"""``queue.partitions``: the keys of each partition, the spread of requests over them, the
configuration's checks, and what an inference process's read and answer send for them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pytest
import redis

from batching.config import ConfigError, ModelConfig
from batching.envelope import Reply, Request, Tensor
from batching.former import Entry
from batching.keys import Keys
from batching.names import valid_name
from batching.partitions import Spread
from batching.resp import Command, ReplyHandler
from batching.resp_cluster import key_slot
from workers.stream_reads import Reads
from workers.streams import ModelStreams

KEYS = Keys("cv")
X = {"name": "x", "datatype": "FP32", "shape": [-1, 4]}


def test_partition_zero_keeps_the_keys_of_one_partition() -> None:
    assert KEYS.queue("m", 2, 0) == KEYS.queue("m", 2) == "cv:{m}:q:2"
    assert KEYS.rows_waiting("m", 0) == "cv:{m}:rows"
    assert KEYS.withdrawn("m", 0) == "cv:{m}:withdrawn"
    [only] = KEYS.partitions("m", 2, 1)
    assert only.streams == ("cv:{m}:q:1", "cv:{m}:q:2")
    assert (only.rows, only.withdrawn) == ("cv:{m}:rows", "cv:{m}:withdrawn")


def test_each_partition_is_one_slot_of_its_own() -> None:
    parts = KEYS.partitions("m", 2, 3)
    assert [p.rows for p in parts] == ["cv:{m}:rows", "cv:{m#1}:rows", "cv:{m#2}:rows"]
    slots = []
    for part in parts:
        keys = [*part.streams, part.rows, part.withdrawn]
        assert len({key_slot(k) for k in keys}) == 1, keys  # scripts take them together
        slots.append(key_slot(part.rows))
    assert len(set(slots)) == 3
    assert key_slot(KEYS.stats("m")) == slots[0]


def test_a_model_name_never_holds_the_partition_mark() -> None:
    assert valid_name("m") and not valid_name("m#1") and not valid_name("#")


def test_spread_takes_the_partitions_in_turn_per_model() -> None:
    spread = Spread()
    picks = [spread.pick("a", 3) for _ in range(30)]
    assert Counter(picks) == {0: 10, 1: 10, 2: 10}
    assert all(picks[i] != picks[i + 1] for i in range(29))
    assert {spread.pick("b", 1) for _ in range(5)} == {0}
    others = [spread.pick("c", 4) for _ in range(8)]
    assert Counter(others) == {0: 2, 1: 2, 2: 2, 3: 2}


def test_spread_starts_each_process_at_a_random_partition() -> None:
    starts = {Spread().pick("m", 8) for _ in range(200)}
    assert len(starts) > 4


def config(**queue: Any) -> ModelConfig:
    raw = {"max_batch_size": 8, "inputs": [X], "outputs": [X], "queue": queue}
    return ModelConfig.from_dict("folder", raw, "python")


def test_partitions_default_to_one_and_share_the_row_limit() -> None:
    assert config().queue.partitions == 1
    assert config(max_queue_rows=100).queue.partition_rows == 100
    assert config(max_queue_rows=100, partitions=3).queue.partition_rows == 34


@pytest.mark.parametrize("queue,expected", [
    ({"partitions": 0}, "queue.partitions must be >= 1, got 0"),
    ({"partitions": 257}, "queue.partitions must be <= 256, got 257"),
    ({"partitions": "3"}, "queue.partitions must be an integer"),
    ({"partitions": 4, "max_queue_rows": 20},
     "each of the 4 partitions holds 5 rows of max_queue_rows (20), fewer than one request"),
])
def test_bad_partitions_are_refused(queue: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config(**queue)
    assert expected in str(caught.value)


def test_one_server_reads_every_partition_in_one_blocking_command() -> None:
    reads = Reads(tuple(KEYS.partitions("m", 2, 3)), "c1", splits=False)
    read, *marks = reads.commands(10, 500, None)
    streams = ["cv:{m}:q:1", "cv:{m#1}:q:1", "cv:{m#2}:q:1",
               "cv:{m}:q:2", "cv:{m#1}:q:2", "cv:{m#2}:q:2"]
    assert list(read) == ["XREADGROUP", "GROUP", "workers", "c1", "COUNT", 4, "BLOCK", 500,
                          "STREAMS", *streams, *[">"] * 6]
    assert [m[1] for m in marks] == ["cv:{m}:withdrawn", "cv:{m#1}:withdrawn",
                                     "cv:{m#2}:withdrawn"]
    assert reads.streams == streams
    urgent = reads.commands(10, None, 1)[0]
    assert "BLOCK" not in urgent and urgent[-6:] == (*streams[:3], ">", ">", ">")


def test_a_cluster_reads_each_partition_apart_without_blocking() -> None:
    reads = Reads(tuple(KEYS.partitions("m", 2, 3)), "c1", splits=True, marks=False)
    commands = reads.commands(3, 500, None)
    assert [c[-4:-2] for c in commands] == [("cv:{m}:q:1", "cv:{m}:q:2"),
                                            ("cv:{m#1}:q:1", "cv:{m#1}:q:2"),
                                            ("cv:{m#2}:q:1", "cv:{m#2}:q:2")]
    assert all("BLOCK" not in c and c[5] == 1 for c in commands)
    assert not reads.blocks
    one = Reads(tuple(KEYS.partitions("m", 2, 1)), "c1", splits=True, marks=False)
    assert one.blocks and "BLOCK" in one.commands(3, 500, None)[0]
    got, marks = reads.entries([[[b"cv:{m}:q:2", ["a"]]], [[b"cv:{m#1}:q:1", ["b"]]], None])
    assert got == [("cv:{m#1}:q:1", ["b"]), ("cv:{m}:q:2", ["a"])] and marks is None


class Writes:
    """A link that records what is sent and answers every command with 1."""

    def __init__(self, splits: bool = False) -> None:
        self.splits = splits
        self.sent: list[Command] = []

    def send(self, commands: Sequence[Command], on_replies: ReplyHandler | None = None) -> None:
        self.sent += commands
        if on_replies is not None:
            on_replies([1] * len(commands))

    def flush(self) -> None:
        """Nothing is deferred."""


def partitioned(link: Writes, count: int = 3) -> ModelStreams:
    first, *more = KEYS.partitions("m", 1, count)
    return ModelStreams(cast(redis.Redis, None), cast(Any, link), list(first.streams),
                        KEYS.stats("m"), first.rows, "c1", suspects_key=KEYS.suspects("m"),
                        withdrawn_key=first.withdrawn, more=tuple(more))


def test_each_entry_is_released_and_unmarked_in_its_own_partition() -> None:
    first, *more = KEYS.partitions("m", 1, 3)
    link = Writes()
    streams = partitioned(link)
    x = Tensor.from_array("x", np.zeros((1, 4), np.float32))
    entries = [Entry(p.streams[0], f"1-{i}", Request(f"r{i}", "reply", 0, 0, 1, [x]), 0.0)
               for i, p in enumerate([first, *more])]
    streams.withdrawn = {e.entry_id: e.stream for e in entries}
    streams.answer([(e, Reply(e.request.id)) for e in entries])
    released = {(c[3], c[4]) for c in link.sent if c[0] == "EVAL"}
    assert released == {(p.rows, p.streams[0]) for p in [first, *more]}
    unmarked = {(c[1], c[2]) for c in link.sent if c[0] == "ZREM"}
    assert unmarked == {(p.withdrawn, f"{e.stream} {e.entry_id}")
                        for p, e in zip([first, *more], entries, strict=True)}


@pytest.mark.parametrize("splits,count,stats_writes", [
    (False, 3, 3), (True, 1, 3), (True, 3, 1)])
def test_a_cluster_writes_a_partitioned_models_statistics_at_intervals(
        splits: bool, count: int, stats_writes: int) -> None:
    """One stats hash, partition 0's slot: on a cluster, with several partitions, three
    answers in a row carry the counters once (the rest wait SPREAD_FLUSH_S)."""
    link = Writes(splits)
    streams = partitioned(link, count)
    x = Tensor.from_array("x", np.zeros((1, 4), np.float32))
    for i in range(3):
        entry = Entry(KEYS.queue("m", 1), f"1-{i}", Request(f"r{i}", "reply", 0, 0, 1, [x]), 0.0)
        streams.answer([(entry, Reply(entry.request.id))], {"success_count": 1})
    assert sum(c[0] == "EVAL" and c[3] == KEYS.stats("m") for c in link.sent) == stats_writes
    assert streams.counts_pending == (stats_writes == 1)
