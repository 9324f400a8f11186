"""What :meth:`workers.streams.ModelStreams.answer` writes, on a link that records it.

On one Redis an answer is one write, the statistics first and the releases after the
replies. On a link whose writes split over nodes (a cluster) the releases go in a second
write, and only once every reply push answered with its list's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pytest
import redis

from batching.envelope import Reply, Request, Tensor
from batching.former import Entry
from batching.keys import Keys
from batching.resp import Command, ReplyHandler, RespError
from workers.streams import ModelStreams

KEYS = Keys("t")
MODEL = "m"


class RecordingLink:
    """A :class:`batching.redis_links.BlockingLink` that records each write and answers
    every ``RPUSH`` with ``push_reply`` (every other command with 1)."""

    def __init__(self, splits: bool, push_reply: Any = 1) -> None:
        self.splits = splits
        self.push_reply = push_reply
        self.writes: list[list[str]] = []
        """Each write's command names (a script by the key it names first)."""
        self._deferred: list[tuple[list[Any], ReplyHandler | None]] = []

    def send(self, commands: Sequence[Command], on_replies: ReplyHandler | None = None) -> None:
        self.writes.append([_name(c) for c in commands])
        replies = [self.push_reply if c[0] == "RPUSH" else 1 for c in commands]
        self._deferred.append((replies, on_replies))

    def execute(self, commands: Sequence[Command], spin_s: float = 0.0) -> list[Any]:
        raise AssertionError("an answer reads nothing")

    def flush(self) -> None:
        while self._deferred:
            replies, handler = self._deferred.pop(0)
            if handler is not None:
                handler(replies)

    def close(self) -> None:
        """Nothing to close."""


def _name(command: Command) -> str:
    if command[0] == "EVAL":
        return f"EVAL {str(command[3]).split(':')[-1]}"  # stats, rows (the release)
    return str(command[0])


def answer_on(link: RecordingLink) -> None:
    streams = ModelStreams(cast(redis.Redis, None), link, KEYS.queues(MODEL, 1),
                           KEYS.stats(MODEL), KEYS.rows_waiting(MODEL), "c1",
                           suspects_key=KEYS.suspects(MODEL))
    x = Tensor.from_array("x", np.zeros((1, 4), np.float32))
    entries = [Entry(KEYS.queue(MODEL, 1), f"1-{i}",
                     Request(f"r{i}", KEYS.reply(f"api{i}"), 0, 0, 1, [x]), 0.0, 1)
               for i in range(2)]
    streams.answer([(e, Reply(e.request.id)) for e in entries], {"success_count": 2})
    streams.settle()


def test_one_redis_gets_one_write_the_releases_after_the_replies() -> None:
    link = RecordingLink(splits=False, push_reply=RespError("WRONGTYPE"))
    answer_on(link)
    assert link.writes == [["EVAL stats", "RPUSH", "EXPIRE", "RPUSH", "EXPIRE", "EVAL rows"]]


def test_a_cluster_releases_once_every_reply_is_pushed() -> None:
    link = RecordingLink(splits=True)
    answer_on(link)
    assert link.writes == [["EVAL stats", "RPUSH", "EXPIRE", "RPUSH", "EXPIRE"], ["EVAL rows"]]


@pytest.mark.parametrize("refusal", [RespError("WRONGTYPE Operation against a key"),
                                     RespError("CLUSTERDOWN The cluster is down"),
                                     ConnectionError("lost"), None])
def test_a_cluster_leaves_the_entries_pending_when_a_push_fails(refusal: object) -> None:
    link = RecordingLink(splits=True, push_reply=refusal)
    answer_on(link)
    assert link.writes == [["EVAL stats", "RPUSH", "EXPIRE", "RPUSH", "EXPIRE"]]
