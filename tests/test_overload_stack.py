"""Past capacity on the real stack (API, Redis, a Celery worker): with the adaptive
policy's overload order (``batching.overload: lifo``, the default for a
model that sets ``latency_target_ms``), a request that is
answered is answered within the latency target, and the excess is refused fast (503 or
504), not answered after a wait, even though every request carries a timeout of 1 s.

The model is a device (bench/device_model.py): each batch of ``n`` rows takes 30 ms +
1 ms·n and no CPU, so the bound holds on a busy host. Measured on a slow 2-core host
(closed-loop capacity 229-277 req/s), at 140% and more: served p99 97-106 ms, refused p99
108-113 ms, none lost, alike with a core kept busy by another process.
With ``fifo`` (the order of deadlines, shedding only what cannot make its own 1 s
deadline) the queue stands at about that timeout: p99 1,004 ms served, 1,009 ms refused.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import uvloop

from bench import device_model, open_loop
from bench.sweep import closed_rps, conveyor, request_body

pytestmark = pytest.mark.serial

MODEL = device_model.NAME
A_S, B_S = 0.030, 0.001
"""The device's batch of ``n`` rows takes 30 ms + 1 ms·n: a full batch (16 rows) 46 ms,
about 350 rows a second, so that the device, not the API process, is what saturates even on
a slow busy host (at 8 ms + 0.5 ms·n, about 1,000 rows a second, a 2-core host whose API
served 714 requests a second in a closed loop was the bottleneck itself, and the served p99
went to 87 ms against a 50 ms target)."""
TARGET_MS = 100.0
TIMEOUT_US = 1_000_000
PAST = 1.4
"""Offered load, as a share of the closed-loop capacity, at first (raised while less than a
tenth is refused: a host that got quicker than measured)."""
SLACK_MS = 25.0
"""What the client's own path (the generator, the API on a busy host) may add to the
target when judging the served requests' p99."""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def test_past_capacity_answers_in_time_or_refuses_fast(tmp_path: Path) -> None:
    device_model.write(tmp_path / "repo", A_S, B_S)
    (tmp_path / "repo" / MODEL / "config.yaml").write_text(
        device_model.CONFIG + f"batching: {{latency_target_ms: {TARGET_MS:g}}}\n")
    body = request_body(MODEL, TIMEOUT_US)
    with conveyor(MODEL, tmp_path / "repo", tmp_path, body) as stack:
        closed_rps(stack, 64, 2.0)  # warm-up: a cold API process lags
        capacity = closed_rps(stack, 64, 2.0)[0]
        share = PAST
        for _ in range(3):  # a host that got quicker than measured: the load rises
            times = open_loop.poisson(share * capacity, 4.0, 11)
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                out = runner.run(open_loop.run(stack.host, stack.port, stack.path, stack.body,
                                               times, 256, warmup_s=1.0))
            if out.count(503) + out.count(504) > 0.1 * out.sent:
                break
            share *= 1.5
    served = [ms for s, ms in zip(out.statuses, out.latencies_ms, strict=True) if s == 200]
    refused = [ms for s, ms in zip(out.statuses, out.latencies_ms, strict=True)
               if s in (503, 504)]
    seen = f"capacity {capacity:.0f}/s, {out.sent} sent: {len(served)} served, " \
           f"p99 {percentile(served, 0.99):.1f} ms; {len(refused)} refused, p99 " \
           f"{percentile(refused, 0.99):.1f} ms; {out.lost} lost"
    assert len(refused) > 0.1 * out.sent, f"never past capacity: {seen}"
    assert len(served) > 0.5 * out.sent / share, seen
    assert percentile(served, 0.99) <= TARGET_MS + SLACK_MS, seen
    assert percentile(refused, 0.99) <= TARGET_MS + SLACK_MS, seen
    assert len(served) + len(refused) + out.lost == out.sent and out.lost == 0, seen
