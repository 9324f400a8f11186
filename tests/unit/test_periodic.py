"""The API's background loops run every interval, survive a failed round, and stop."""

from __future__ import annotations

import asyncio

import pytest

from api.periodic import Periodic


def test_it_runs_every_interval_survives_a_failure_and_stops(
        caplog: pytest.LogCaptureFixture) -> None:
    rounds: list[int] = []

    async def action() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 2:
            raise RuntimeError("Redis went away")

    async def scenario() -> int:
        loop = Periodic("conveyor-test", 0.01, action)
        loop.start()
        while len(rounds) < 4:
            await asyncio.sleep(0.01)
        await loop.close()
        stopped_at = len(rounds)
        await asyncio.sleep(0.05)
        assert len(rounds) == stopped_at
        return stopped_at

    assert asyncio.run(scenario()) >= 4
    assert "conveyor-test: this round failed" in caplog.text


def test_closing_a_loop_that_never_started_is_harmless() -> None:
    async def action() -> None:
        raise AssertionError("never runs")

    asyncio.run(Periodic("idle", 1.0, action).close())
