"""An API process whose event loop has fallen behind refuses at once, with 503 and
Retry-After, the requests it could no longer answer within their timeout (api/overload.py),
and only those."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.overload import IDLE_ROUNDS, INTERVAL_S, RATE_S, REFUSALS_PER_ANSWER, Overload
from batching.errors import Overloaded
from batching.settings import Settings
from tests.unit.conftest import serve
from tests.unit.memory_dispatch import MemoryDispatcher


def test_a_loop_that_keeps_up_refuses_nothing_whatever_the_requests_took() -> None:
    overload = Overload(lag_s=0.004)
    overload.answered("m", 10.0)
    overload.check("m", 0.001)


def test_behind_a_request_that_would_be_late_is_refused_and_one_with_time_is_not() -> None:
    overload = Overload(lag_s=0.030, probe_s=3600.0)
    overload.answered("m", 0.030)
    overload.answered("m", 0.030)
    overload.check("m", 0.100)  # the lag unread (the socket's turn) plus 30 ms: 60 ms
    with pytest.raises(Overloaded, match=r"about 60 ms .*\(30 ms of it waiting to be read\)"):
        overload.check("m", 0.050)
    overload.check("other", 0.050)  # nothing known of it but the lag: 30 ms


def test_while_refusing_one_request_per_probe_interval_still_goes_through() -> None:
    """Else the time requests take would stay what the last served ones took, and a
    refusal that began would never end."""
    overload = Overload(lag_s=0.030, probe_s=3600.0)
    overload.answered("m", 0.030)
    overload.check("m", 0.050)  # the first since the lag began: it goes, and is measured
    with pytest.raises(Overloaded):
        overload.check("m", 0.050)
    overload.probe_s = 0.0
    overload.check("m", 0.050)


def test_a_request_read_soon_after_its_connection_was_quiet_is_not_judged_by_the_lag() -> None:
    """A closed-loop client (or one retrying a 503 at once) cannot have a request waiting
    unread longer than its connection has had one in hand, however late the loop runs."""
    overload = Overload(lag_s=0.030, probe_s=3600.0)
    for _ in range(10):
        overload.answered("m", 0.030)
    overload.check("m", 0.050)  # the first since the lag began goes through
    overload.check("m", 0.050, unread_at_most=0.002)  # 32 ms expected: in time
    with pytest.raises(Overloaded, match=r"about 60 ms .*\(30 ms of it waiting"):
        overload.check("m", 0.050)  # the lag unread: 30 ms
    with pytest.raises(Overloaded, match=r"about 55 ms .*\(25 ms of it waiting"):
        overload.check("m", 0.050, unread_at_most=0.025)


def test_refusals_of_clients_back_at_once_stay_within_a_budget_of_the_answers() -> None:
    """A loop kept behind by the refusals themselves (their clients back at once, on
    connections just answered) must not go on refusing nearly everything: past the budget,
    such requests go through. Requests that may have waited unread (no bound known: a
    connection's first) are refused whatever the budget: an open-loop flood."""
    overload = Overload(lag_s=0.030, probe_s=3600.0)
    back_at_once = 0.020
    overload.check("m", 0.010, back_at_once)  # the first since the lag began goes through
    overload.check("m", 0.010, back_at_once)  # nothing answered yet: no budget to refuse with
    with pytest.raises(Overloaded):
        overload.check("m", 0.010)
    for _ in range(5):
        overload.answered("m", 0.030)
    refused = 0
    for _ in range(100):
        try:
            overload.check("m", 0.010, back_at_once)
        except Overloaded:
            refused += 1
    # Five answers' worth, less the refusal above and what the counts decayed meanwhile.
    assert REFUSALS_PER_ANSWER * 5 - 3 <= refused <= REFUSALS_PER_ANSWER * 5 - 1
    overload.answered("m", 0.030)  # one more answer earns about four more refusals
    with pytest.raises(Overloaded):
        overload.check("m", 0.010, back_at_once)
    for _ in range(10):  # the budget binds only the bounded
        with pytest.raises(Overloaded):
            overload.check("m", 0.010)


def test_an_early_check_that_passes_leaves_the_probe_to_the_request_checked_after_it() -> None:
    """A check against the model's default timeout, before the body is read, passes nearly
    every request; were it to count as the probe, no probe would reach the check that
    judges the request by its own timeout, and a refusal that began would never end."""
    overload = Overload(lag_s=0.030, probe_s=0.050)
    overload.answered("m", 0.030)
    overload.check("m", 0.050)  # the first since the lag began goes through
    overload._passed["m"] = time.monotonic() - 1.0  # a probe is due
    overload.check("m", 30.0, final=False)
    overload.check("m", 0.050)  # the probe
    with pytest.raises(Overloaded):
        overload.check("m", 0.050)
    with pytest.raises(Overloaded):  # an early check refuses as the final one does
        overload.check("m", 0.050, final=False)


def test_the_time_requests_took_is_smoothed() -> None:
    overload = Overload()
    overload.answered("m", 0.010)
    for _ in range(60):
        overload.answered("m", 0.050)
    assert abs(overload.took_s["m"] - 0.050) < 0.001
    overload.answered("m", 0.0)
    assert 0.040 < overload.took_s["m"] < 0.050  # one quick answer moves it a tenth of the way


def test_the_lag_follows_a_blocked_loop_and_falls_back_when_it_runs_free() -> None:
    async def run() -> tuple[float, float]:
        overload = Overload()
        overload.start()
        try:
            for _ in range(5):  # the loop blocked 80 ms at a time, as a saturated one is
                time.sleep(0.08)
                await asyncio.sleep(0.006)
            behind = overload.lag_s
            await asyncio.sleep(0.5)
            return behind, overload.lag_s
        finally:
            await overload.close()

    behind, free = asyncio.run(run())
    assert behind > 0.01  # twice the lag a loop that keeps up may show
    assert free < behind / 2  # a busy host's wake-ups may still run a few ms late


async def stopped(overload: Overload, within_s: float = 3.0) -> bool:
    """Whether the sampler stops within ``within_s`` (a busy host's rounds come late)."""
    ends = time.monotonic() + within_s
    while overload.sampling and time.monotonic() < ends:
        await asyncio.sleep(0.01)
    return not overload.sampling


def test_an_idle_process_stops_sampling_and_the_next_request_starts_it_again() -> None:
    """No request checked for IDLE_ROUNDS rounds: the sampler stops, so an idle API is not
    woken 200 times a second, and the lag reads 0. A request starts it again, and a loop
    that falls behind then shows it."""
    async def run() -> None:
        overload = Overload()
        overload.start()
        try:
            assert overload.sampling
            time.sleep(0.05)  # the loop blocked: the first round comes late
            await asyncio.sleep(2 * INTERVAL_S)
            assert overload.lag_s > 0.0
            assert await stopped(overload)
            assert overload.lag_s == 0.0
            overload.check("m", 1.0)
            assert overload.sampling
            for _ in range(5):  # blocked 80 ms at a time, as a saturated loop is
                time.sleep(0.08)
                await asyncio.sleep(0.006)
                overload.check("m", 1.0)
            assert overload.lag_s > 0.01
        finally:
            await overload.close()

    asyncio.run(run())


def test_requests_keep_the_sampler_running() -> None:
    async def run() -> bool:
        overload = Overload()
        overload.start()
        try:
            for _ in range(3 * IDLE_ROUNDS):  # a request every round, for three idle spans
                overload.check("m", 1.0)
                await asyncio.sleep(INTERVAL_S)
            return overload.sampling
        finally:
            await overload.close()

    assert asyncio.run(run())


def test_the_budgets_counts_age_over_the_time_the_sampler_was_stopped() -> None:
    """The answers that earn refusals decay with RATE_S whether or not the sampler ran:
    half a second stopped leaves about e^-2 of them, not all."""
    async def run() -> float:
        overload = Overload()
        overload.start()
        try:
            for _ in range(100):
                overload.answered("m", 0.001)
            assert await stopped(overload)
            await asyncio.sleep(0.5)
            overload.check("m", 1.0)
            await asyncio.sleep(3 * INTERVAL_S)  # a round ages them
            return overload._answers
        finally:
            await overload.close()

    assert asyncio.run(run()) < 100 * math.exp(-0.5 / RATE_S)


def test_answers_of_half_a_second_ago_fund_few_refusals() -> None:
    """A loop that falls behind after a second of answers at full speed must not spend
    them on seconds of refusals: with clients back at once, each refusal brings one more
    request, and refusals cost the API most of what answers do (api/overload.py RATE_S)."""
    async def run() -> int:
        overload = Overload(probe_s=3600.0)
        overload.start()
        try:
            for _ in range(1000):
                overload.answered("m", 0.030)
            await asyncio.sleep(0.5)
            overload.check("m", 1.0)  # starts the sampler again, stopped meanwhile
            await asyncio.sleep(3 * INTERVAL_S)  # a round ages the counts
            overload.lag_s = 0.030
            refused = 0
            for _ in range(5000):
                try:
                    overload.check("m", 0.010, 0.020)
                except Overloaded:
                    refused += 1
            return refused
        finally:
            await overload.close()

    assert asyncio.run(run()) < REFUSALS_PER_ANSWER * 1000 * math.exp(-1.0)


@contextmanager
def overloaded(settings: Settings, dispatcher: MemoryDispatcher,
               default_timeout_ms: int | None = None) -> Iterator[TestClient]:
    """The API with echo served, its loop 40 ms behind and 30 ms per echo request, no
    probe due; ``default_timeout_ms``: echo's, in place of its configuration's."""
    dispatcher.beat("echo")
    app = serve(settings, dispatcher)
    with app as client:
        service = app.app.app.service  # type: ignore[attr-defined]
        if default_timeout_ms is not None:
            echo = service.models["echo"]
            service.models["echo"] = replace(
                echo, queue=replace(echo.queue, default_timeout_ms=default_timeout_ms))
        overload = service.overload
        overload.interval_s = 3600.0  # the sampler sleeps: the lag stays as set here
        time.sleep(0.02)
        overload.lag_s = 0.040
        overload.answered("echo", 0.030)  # answers earn the refusals' budget
        overload.probe_s = 3600.0
        overload.check("echo", 1.0)  # a request went through just now: no probe is due
        yield client


def test_the_api_answers_503_with_retry_after_without_reaching_the_dispatcher(
        settings: Settings, dispatcher: MemoryDispatcher) -> None:
    with overloaded(settings, dispatcher) as client:
        x = np.ones((1, 4), np.float32).ravel().tolist()

        def infer(timeout_us: int) -> tuple[int, dict[str, str], dict[str, str]]:
            doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": x}],
                   "parameters": {"timeout": timeout_us}}
            got = client.post("/v2/models/echo/infer", json=doc)
            return got.status_code, dict(got.headers), got.json()

        status, headers, answer = infer(50_000)
        assert status == 503 and headers["retry-after"] == "1"
        assert "overloaded" in answer["error"] and not dispatcher.submitted
        status, _, _ = infer(1_000_000)  # 110 ms expected: within a second's timeout
        assert status == 200 and len(dispatcher.submitted) == 1
        scrape = client.get("/metrics").text
        assert 'conveyor_requests_total{model="echo",outcome="overloaded"} 1.0' in scrape
        assert "conveyor_api_event_loop_lag_seconds" in scrape


def test_an_overloaded_process_refuses_before_it_decodes_the_tensors(
        settings: Settings, dispatcher: MemoryDispatcher) -> None:
    """Decoding JSON tensors is most of a parse: the check comes first. A tensor with too
    few values (400 once decoded) with 50 ms to spare is refused; with a second, the
    decoding is reached and answers 400."""
    with overloaded(settings, dispatcher) as client:
        def infer(timeout_us: int) -> int:
            doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1.0]}],
                   "parameters": {"timeout": timeout_us}}
            return client.post("/v2/models/echo/infer", json=doc).status_code

        assert infer(50_000) == 503
        assert infer(1_000_000) == 400
        assert not dispatcher.submitted


def test_a_request_its_models_default_timeout_cannot_save_is_refused_before_it_is_parsed(
        settings: Settings, dispatcher: MemoryDispatcher) -> None:
    """A request's own timeout can only shorten its model's default: when even the default
    would be missed, the body is not parsed (this one is not even JSON)."""
    with overloaded(settings, dispatcher, default_timeout_ms=50) as client:
        got = client.post("/v2/models/echo/infer", content=b"{not json")
        assert got.status_code == 503 and got.headers["retry-after"] == "1"
        assert "overloaded" in got.json()["error"]
    with overloaded(settings, dispatcher, default_timeout_ms=1000) as client:
        assert client.post("/v2/models/echo/infer", content=b"{not json").status_code == 400
