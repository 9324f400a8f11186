"""Past what the API process itself can serve, its HTTP listener refuses at once (503, the
body skipped, no application task) the requests of a ``lifo`` model that have waited
unread too long to be answered within its latency target, and the ones it serves stay
within it (api/http_guard.py, api/turns.py, api/overload.py ``refuses_unread``).

The API is made the bottleneck without timing: every request holds the event loop for
``HOLD_S`` (the API's own work, which does not shrink on a busy host), and the client sends
twice as many as that allows, open loop. Served first come, first served, the backlog
would grow for the whole run: the served requests' p99 would be about a second."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from api.http_guard import RECEIVED_AT, ConnectionLimits
from api.metrics import ApiMetrics
from api.overload import Overload
from batching.config import BatchingConfig, ModelConfig
from batching.errors import Overloaded
from bench import open_loop
from tests.guarded_server import guarded_server, send_whole

pytestmark = pytest.mark.serial

LIMITS = ConnectionLimits(keepalive_s=30.0, header_timeout_s=30.0, body_timeout_s=30.0,
                          max_connections=4096)
HOLD_S = 0.004
"""The loop is held this long by every request served: at most 250 a second."""
RATE = 2.0 / HOLD_S
SECONDS = 3.0
TARGET_MS = 100.0
SLACK_MS = 250.0
"""What a busy host may add to the target, for the client's and the listener's own work."""
PATH = "/v2/models/m/infer"
BODY = b'{"inputs": []}'


class SlowApi:
    """An infer route whose requests each hold the loop, with the service's overload
    bookkeeping (the check that keeps the lag sampled, the time each one took)."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.overload = Overload(probe_s=0.5)
        self.metrics = ApiMetrics()
        self.served = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.overload.turns is None:
            self.overload.start(self.metrics.refused)
        self.overload.learn("m", self.config)
        while (await receive()).get("more_body"):
            pass
        try:
            self.overload.check("m", 1.0)
        except Overloaded:
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        time.sleep(HOLD_S)  # the API's own work: the loop does nothing else meanwhile
        await asyncio.sleep(0.001)  # the model
        await send_whole(send, b"{}")
        self.served += 1
        self.overload.answered("m", time.perf_counter() - scope[RECEIVED_AT])


def run_past_capacity(api: SlowApi, seconds: float = SECONDS) -> open_loop.Outcome:
    with guarded_server(api, LIMITS) as port:
        times = open_loop.poisson(RATE, seconds + 0.5, 38)
        return asyncio.run(open_loop.run("127.0.0.1", port, PATH, BODY, times, 128,
                                         warmup_s=0.5, drain_s=20.0))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@pytest.fixture(scope="module")
def lifo() -> Iterator[tuple[SlowApi, open_loop.Outcome]]:
    api = SlowApi(ModelConfig("m", "onnx", batching=BatchingConfig(latency_target_ms=TARGET_MS,
                                                                      overload="lifo")))
    yield api, run_past_capacity(api)


def test_past_capacity_the_stale_are_refused_fast_and_the_served_stay_in_time(
        lifo: tuple[SlowApi, open_loop.Outcome]) -> None:
    api, out = lifo
    served = [ms for s, ms in zip(out.statuses, out.latencies_ms, strict=True) if s == 200]
    refused = [ms for s, ms in zip(out.statuses, out.latencies_ms, strict=True) if s == 503]
    seen = (f"{out.sent} sent: {len(served)} served, p99 {percentile(served, 0.99):.0f} ms; "
            f"{len(refused)} refused ({api.overload.refused_unread} unread), p99 "
            f"{percentile(refused, 0.99):.0f} ms; {out.lost} lost")
    assert len(refused) > 0.2 * out.sent, f"never past capacity: {seen}"
    assert api.overload.refused_unread > 0.9 * len(refused), seen
    assert len(served) > 0.25 * out.sent, seen  # at least half of what the loop can serve
    assert percentile(served, 0.99) <= TARGET_MS + SLACK_MS, seen
    assert percentile(refused, 0.99) <= TARGET_MS + SLACK_MS, seen
    assert out.lost == 0 and len(served) + len(refused) == out.sent, seen
    counted = api.metrics.registry.get_sample_value(
        "conveyor_requests_total", {"model": "m", "outcome": "overloaded"})
    assert counted == api.overload.refused_unread, seen  # /metrics tells them


def test_a_fifo_model_is_never_refused_for_its_unread_wait() -> None:
    config = ModelConfig("m", "onnx", batching=BatchingConfig(latency_target_ms=TARGET_MS,
                                                              overload="fifo"))
    api = SlowApi(config)
    out = run_past_capacity(api, 1.0)
    assert api.overload.refused_unread == 0
    assert out.count(200) > 0
