"""``conveyor_redis_up``: 1 after a scrape that read Redis, 0 after one it could not."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from api.metrics_shared import SharedState
from batching.keys import Keys


class _Pipeline:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None

    async def execute(self) -> list[Any]:
        if self.fail:
            raise RedisConnectionError("Redis went away")
        return [{}]  # the jobs counts: no model is served


class _Redis:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def pipeline(self, transaction: bool = True) -> _Pipeline:
        return _Pipeline(self.fail)


def up(state: SharedState) -> float:
    family = next(m for m in state.collect() if m.name == "conveyor_redis_up")
    return float(family.samples[0].value)


def test_redis_up_follows_each_scrape() -> None:
    state = SharedState()
    assert up(state) == 0.0
    asyncio.run(state.refresh(_Redis(False), Keys("t"), {}, {}))  # type: ignore[arg-type]
    assert up(state) == 1.0
    asyncio.run(state.refresh(_Redis(True), Keys("t"), {}, {}))  # type: ignore[arg-type]
    assert up(state) == 0.0
