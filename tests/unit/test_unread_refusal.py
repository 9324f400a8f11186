"""How long the bytes read now can have waited (api/turns.py), and the listener's refusal
of a ``lifo`` model's request that waited too long (api/overload.py ``refuses_unread``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from api.overload import KEEPING_UP_S, Overload
from api.turns import ROUNDS, TurnClock
from batching.config import BatchingConfig, ModelConfig, QueueConfig

HOLD_S = 0.05


async def next_turn() -> None:
    await asyncio.sleep(0)


def test_a_read_is_bounded_by_the_turn_before_its_own_and_idle_loops_are_not() -> None:
    async def scenario() -> None:
        clock = TurnClock(asyncio.get_running_loop())
        assert clock.read() is None  # the loop's previous turn is not known
        await next_turn()
        assert clock.read() is None  # the chain of ticks has only begun
        before_hold = time.perf_counter()
        await next_turn()
        assert clock.read() is not None
        time.sleep(HOLD_S)  # a long turn: what is read next may have waited all of it
        await next_turn()
        bound = clock.read()
        assert bound is not None and time.perf_counter() - bound >= HOLD_S
        assert bound >= before_hold
        assert clock.read() == bound  # the same turn, the same bound
        for _ in range(ROUNDS + 2):  # no reads: the ticks stop
            await next_turn()
        assert clock.read() is None

    asyncio.run(scenario())


def config(overload: str = "lifo", adaptive: bool = True,
           timeout_ms: int = 30_000) -> ModelConfig:
    return ModelConfig("m", "onnx", batching=BatchingConfig(
        latency_target_ms=50.0, adaptive=adaptive, overload=overload),
        queue=QueueConfig(default_timeout_ms=timeout_ms))


@pytest.mark.parametrize(("model", "budget_s"), [
    (config(), 0.05), (config(timeout_ms=20), 0.02),
    (config(overload="fifo"), None), (config(adaptive=False), None)])
def test_only_an_adaptive_lifo_model_has_a_budget(model: ModelConfig,
                                                  budget_s: float | None) -> None:
    overload = Overload()
    overload.learn("m", config())
    overload.learn("m", model)
    assert overload.unread_budget_s.get("m") == budget_s


def test_behind_a_request_that_waited_too_long_is_refused_and_one_in_time_is_not() -> None:
    overload = Overload(lag_s=2 * KEEPING_UP_S, probe_s=3600.0)
    overload.learn("m", config())
    overload.answered("m", 0.04)
    assert overload.refuses_unread("m", 0.030)  # a probe is due, but it waited too long
    assert not overload.refuses_unread("m", 0.020)  # 20 + 40 ms, but a probe: it goes
    overload.check("m", 1.0)  # it went through
    assert overload.refuses_unread("m", 0.020)
    assert not overload.refuses_unread("m", 0.005)  # 5 + 40 ms: within 50
    assert not overload.refuses_unread("other", 10.0)  # no budget: never seen here
    overload.lag_s = KEEPING_UP_S  # the refusals brought the lag down: still judged
    assert overload.refuses_unread("m", 0.020)
    assert not overload.refuses_unread("m", 0.005)
    assert overload.refused_unread == 3


def test_a_loop_that_keeps_up_and_refused_nothing_lately_refuses_nothing() -> None:
    overload = Overload(lag_s=KEEPING_UP_S, probe_s=3600.0)
    overload.learn("m", config())
    overload.check("m", 1.0)
    assert not overload.refuses_unread("m", 10.0)
    assert overload.refused_unread == 0
