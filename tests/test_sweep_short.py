"""The batching sweep, short: mlp_medium on the real stack, the adaptive policy against a
fixed window of 0 at a load near capacity and one well past it (bench/RESULTS-batching.md
has the full sweep: python -m bench.sweep).

Near capacity every policy answers nearly everything in time, so the adaptive policy must
not lose more than noise; past capacity a fixed window runs requests that finish after
their deadline while more queue behind them, and the adaptive policy, which answers at once
those a batch can no longer answer in time, must keep strictly more goodput.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.models import write_repository
from bench.scheduler_sim import Device
from bench.sweep import closed_rps, conveyor, measure, request_body, write_config
from bench.sweep_report import Point, Setting

MODEL = "mlp_medium"
TARGET_MS = 50.0


def goodput(repo: Path, work: Path, setting: Setting, shares: list[float],
            capacity: float | None = None) -> tuple[float, list[Point]]:
    args = argparse.Namespace(point_s=3.0, warmup_s=1.0, target_ms=TARGET_MS, max_lag_ms=1e9)
    body = request_body(MODEL, int(TARGET_MS * 1000))
    write_config(repo, MODEL, setting, TARGET_MS)
    with conveyor(MODEL, repo, work, body) as stack:
        closed_rps(stack, 64, 1.0)
        if capacity is None:
            capacity = max(closed_rps(stack, c, 2.0)[0] for c in (64, 256))
        device = Device("unused", 0.001)
        points = [measure(stack, setting, "poisson", s, capacity, args, device, 0.0) for s in shares]
    return capacity, points


def test_adaptive_keeps_goodput_past_capacity_and_ties_near_it(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_repository(repo)
    shares = [0.95, 2.0]
    capacity, adaptive = goodput(repo, tmp_path, Setting(True, 0), shares)
    _, fixed = goodput(repo, tmp_path, Setting(False, 0), shares, capacity)
    near, past = zip(adaptive, fixed, strict=True)
    assert near[0].goodput >= 0.8 * near[1].goodput, (near[0].line(), near[1].line())
    assert past[0].goodput > past[1].goodput, (past[0].line(), past[1].line())
