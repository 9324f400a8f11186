"""How long the bytes read now can have waited (api/turns.py), and the listener's refusal
of a ``lifo`` model's request that waited too long (api/overload.py ``refuses_unread``)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from api.overload import CLIENTS, CLIENTS_S, KEEPING_UP_S, RETURNS_S, STANDING_S, Overload
from api.turns import ROUNDS, TurnClock
from batching.config import BatchingConfig, ModelConfig, QueueConfig

HOLD_S = 0.05
CYCLE = itertools.cycle(range(CLIENTS))


def refuses(overload: Overload, model: str, waited_s: float) -> bool:
    """``refuses_unread`` for requests from ``CLIENTS`` connections in turn."""
    return overload.refuses_unread(model, waited_s, next(CYCLE))


def with_clients(overload: Overload) -> Overload:
    """``CLIENTS`` connections have sent m a request that did not wait."""
    for client in range(CLIENTS):
        assert not overload.refuses_unread("m", 0.0, client)
    return overload


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


def test_in_a_standing_backlog_a_request_that_waited_too_long_is_refused() -> None:
    overload = Overload(lag_s=2 * KEEPING_UP_S, probe_s=3600.0,
                        standing_s=0.0)  # a backlog stands as soon as it is there
    overload.learn("m", config())  # a budget of 50 ms; judged by the longest wait
    overload.answered("m", 0.04)
    with_clients(overload)
    assert refuses(overload, "m", 0.060)  # a probe is due, but it waited too long
    assert not refuses(overload, "m", 0.020)  # 20 + 40 ms, but a probe: it goes
    overload.check("m", 1.0)  # it went through
    assert refuses(overload, "m", 0.020)  # the whole of its wait, not half of it
    overload.took_s["m"] = 0.03
    assert refuses(overload, "m", 0.015)  # 45 ms: within the budget, not HEADROOM
    assert not refuses(overload, "m", 0.010)  # 10 ms: under the target, no backlog
    assert not refuses(overload, "other", 10.0)  # no budget: never seen here
    assert overload.refused_unread == 3


class Clock:
    """``time.monotonic`` for api/overload.py, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr("api.overload.time", clock)
    return clock


def behind() -> Overload:
    overload = Overload(lag_s=2 * KEEPING_UP_S, probe_s=3600.0)  # judged by the interval
    overload.learn("m", config())  # a budget of 50 ms, a target of 12.5
    overload.answered("m", 0.04)
    overload.check("m", 1.0)  # a request went through: no probe due
    return with_clients(overload)


def test_a_burst_or_a_long_turn_shorter_than_the_interval_refuses_nothing(
        clock: Clock) -> None:
    overload = behind()
    assert STANDING_S == 0.1
    for _ in range(5):  # bursts of 60 ms, the reads between them fresh again
        for _ in range(60):
            assert not refuses(overload, "m", 0.03)
            clock.now += 0.001
        assert not refuses(overload, "m", 0.002)
    assert not any(refuses(overload, "m", 0.075) for _ in range(100))  # one turn
    assert overload.refused_unread == 0


def test_a_backlog_not_of_the_models_own_clients_refuses_none_of_their_requests(
        clock: Clock) -> None:
    """Waits as long as in the tests below, from fewer than ``CLIENTS`` connections: what
    waits unread is not m's requests (a flood of connections, a starved host)."""
    overload = Overload(lag_s=2 * KEEPING_UP_S, probe_s=3600.0)
    overload.learn("m", config())
    overload.answered("m", 0.04)
    overload.check("m", 1.0)
    few = range(CLIENTS - 1)
    assert not any(overload.refuses_unread("m", 0.5, c) for _ in range(50) for c in few)
    assert overload.refuses_unread("m", 0.5, CLIENTS)  # one more client: m's backlog
    clock.now += 2 * CLIENTS_S + 0.001  # it has gone quiet, and is forgotten
    assert not any(overload.refuses_unread("m", 0.5, c) for _ in range(50) for c in few)


def test_a_backlog_standing_for_the_interval_is_refused_until_fresh_for_as_long(
        clock: Clock) -> None:
    overload = behind()
    for _ in range(80):  # each above the target since 17.5 ms before its read
        assert not refuses(overload, "m", 0.03)
        clock.now += 0.001
    clock.now += 0.003
    assert refuses(overload, "m", 0.03)  # 100 ms above the target
    assert refuses(overload, "m", 0.5)  # a turn past the interval: still standing
    clock.now += 1.5  # the loop is idle a while: the next reads are a new run
    assert not refuses(overload, "m", 0.03)
    assert refuses(overload, "m", 0.125)  # one turn longer than the interval
    for _ in range(99):  # fresh reads, while took + deviations still exceed the headroom
        assert refuses(overload, "m", 0.002) == (overload.took_s["m"] > 0.038)
        clock.now += 0.001
    overload.took_s["m"] = 0.045
    assert refuses(overload, "m", 0.01)  # 10 + 45 ms: still standing
    clock.now += 0.002
    assert not refuses(overload, "m", 0.002)  # below for 100 ms: it has ended
    clock.now += RETURNS_S
    assert not refuses(overload, "m", 0.03)  # a new one, not standing yet


def test_a_backlog_back_within_a_second_stands_at_once(clock: Clock) -> None:
    overload = behind()
    clock.now += 0.2
    assert refuses(overload, "m", 0.5)  # standing at once: 500 ms judged
    for _ in range(101):
        refuses(overload, "m", 0.002)
        clock.now += 0.001
    assert not refuses(overload, "m", 0.002)  # ended
    clock.now += 0.5
    assert refuses(overload, "m", 0.06)  # back, within RETURNS_S
    assert RETURNS_S > 0.5

