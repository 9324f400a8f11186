"""The event loop's lateness, and what the API takes off the deadline the worker sees."""

from __future__ import annotations

import asyncio
import time

from api.loop_lag import LoopLag
from batching.envelope import Reply, Request
from batching.keys import Keys
from tests.unit.conftest import echo, serve, unit_settings
from tests.unit.memory_dispatch import MemoryDispatcher

TIMEOUT_US = 1_000_000
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}],
        "parameters": {"timeout": TIMEOUT_US}}


def test_a_steady_lateness_is_learned_within_a_few_time_constants() -> None:
    lag = LoopLag(period_s=0.005, tau_s=0.1)
    for _ in range(200):  # one second of timers, each 20 ms late
        lag.observe(0.02, 0.005)
    assert abs(lag.seconds - 0.02) < 0.001
    for _ in range(200):
        lag.observe(0.0, 0.005)
    assert lag.seconds < 0.001


def test_the_reserve_is_twice_the_lag_and_never_more_than_half_the_timeout() -> None:
    lag = LoopLag()
    lag.seconds = 0.004
    assert lag.reserve_ms(50.0) == 8
    lag.seconds = 0.1
    assert lag.reserve_ms(50.0) == 25


def test_a_blocked_loop_reads_late_and_an_idle_one_does_not() -> None:
    async def scenario() -> tuple[float, float]:
        lag = LoopLag(period_s=0.005, tau_s=0.1)
        lag.start()
        await asyncio.sleep(0.3)
        idle = lag.seconds
        for _ in range(15):  # callbacks that hold the loop for 30 ms each
            time.sleep(0.03)
            await asyncio.sleep(0)
        blocked = lag.seconds
        lag.stop()
        return idle, blocked

    idle, blocked = asyncio.run(scenario())
    assert blocked > 0.01 and blocked > 2 * idle, (idle, blocked)


def test_the_worker_sees_the_deadline_less_the_api_s_own_waits() -> None:
    settings = unit_settings()

    def slow_echo(request: Request) -> Reply:
        time.sleep(0.03)  # on the API's loop: every request holds it 30 ms
        return echo(request)

    dispatcher = MemoryDispatcher(Keys(settings.key_prefix), slow_echo)
    dispatcher.beat("echo")
    with serve(settings, dispatcher) as client:
        for _ in range(20):
            assert client.post("/v2/models/echo/infer", json=BODY).status_code == 200
    first, last = (request for _, request in (dispatcher.submitted[0], dispatcher.submitted[-1]))
    given = [r.deadline_ms - r.enq_ms for r in (first, last)]
    assert given[0] <= TIMEOUT_US // 1000
    assert given[1] < given[0] - 20, given  # about twice the 30 ms the loop is held less
