"""An API process whose event loop has fallen behind refuses at once, with 503 and
Retry-After, the requests it could no longer answer within their timeout (api/overload.py),
and only those."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.overload import REFUSALS_PER_ANSWER, Overload
from batching.errors import Overloaded
from batching.settings import Settings
from tests.unit.conftest import serve
from tests.unit.memory_dispatch import MemoryDispatcher


def test_a_loop_that_keeps_up_refuses_nothing_whatever_the_requests_took() -> None:
    overload = Overload(lag_s=0.004)
    overload.answered("m", 10.0)
    overload.check("m", 0.001)


def test_behind_a_request_that_would_be_late_is_refused_and_one_with_time_is_not() -> None:
    overload = Overload(lag_s=0.020, probe_s=3600.0)
    overload.answered("m", 0.030)
    overload.answered("m", 0.030)
    overload.check("m", 0.100)  # twice the lag unread plus 30 ms: 70 ms
    with pytest.raises(Overloaded, match=r"about 70 ms .*\(40 ms of it waiting to be read\)"):
        overload.check("m", 0.050)
    overload.check("other", 0.050)  # nothing known of it but the lag: 40 ms


def test_while_refusing_one_request_per_probe_interval_still_goes_through() -> None:
    """Else the time requests take would stay what the last served ones took, and a
    refusal that began would never end."""
    overload = Overload(lag_s=0.020, probe_s=3600.0)
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
    with pytest.raises(Overloaded, match=r"about 90 ms .*\(60 ms of it waiting"):
        overload.check("m", 0.050)  # twice the lag unread: 60 ms
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


def test_the_api_answers_503_with_retry_after_without_reaching_the_dispatcher(
        settings: Settings, dispatcher: MemoryDispatcher) -> None:
    dispatcher.beat("echo")
    app = serve(settings, dispatcher)
    with app as client:
        assert isinstance(client, TestClient)
        overload = app.app.app.service.overload  # type: ignore[attr-defined]
        overload.sampler.interval_s = 3600.0  # the sampler sleeps: the lag stays as set here
        time.sleep(0.02)
        overload.lag_s = 0.040
        overload.answered("echo", 0.030)  # answers earn the refusals' budget
        overload.probe_s = 3600.0
        overload.check("echo", 1.0)  # a request went through just now: no probe is due
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
