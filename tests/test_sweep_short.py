"""The batching sweep, short: mlp_medium on the real stack, the adaptive policy against a
fixed window of 0 at a load near capacity and one past it (bench/RESULTS-batching.md has
the full sweep: python -m bench.sweep).

Near capacity every policy answers nearly everything in time, so the adaptive policy must
not lose more than noise. Past capacity, without shedding, everything queued becomes late
and goodput falls to nothing (it did, for every policy, before the API refused what it
could no longer answer in time: api/overload.py); the stack must keep a good share of
what it served near capacity.

On a busy host the closed-loop capacity measured first can be far from what the stack
serves a minute later, so both stacks run side by side (the idle one costs next to
nothing) and their points alternate; the fixed window proves the "past" load is past
capacity (it left at least a tenth of what was offered late or unanswered); when it did
not, the load is raised and that point measured again.
"""

from __future__ import annotations

import argparse
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import pytest

from bench.models import write_repository
from bench.scheduler_sim import Device
from bench.sweep import (
    Stack,
    capacity_rps,
    closed_rps,
    conveyor,
    measure,
    request_body,
    write_config,
)
from bench.sweep_report import Point, Setting

pytestmark = pytest.mark.serial

MODEL = "mlp_medium"
TARGET_MS = 50.0
NEAR, PAST = 0.95, 1.3
KEPT_NEAR = 0.8
"""Near capacity, the adaptive policy's goodput is at least this share of the fixed window's."""
HELD_PAST = 0.3
"""At 130%, goodput is at least this share of the fixed window's near capacity."""
ARGS = argparse.Namespace(point_s=3.0, warmup_s=1.0, target_ms=TARGET_MS, max_lag_ms=1e9)
DEVICE = Device("unused", 0.001)


def serving(repo: Path, work: Path, setting: Setting) -> AbstractContextManager[Stack]:
    write_config(repo, MODEL, setting, TARGET_MS)
    return conveyor(MODEL, repo, work, request_body(MODEL, int(TARGET_MS * 1000)))


def point(stack: Stack, setting: Setting, share: float, capacity: float) -> Point:
    return measure(stack, setting, "poisson", share, capacity, ARGS, DEVICE, 0.0)


def test_adaptive_ties_near_capacity_and_goodput_holds_past_it(tmp_path: Path) -> None:
    fixed_0, adaptive = Setting(False, 0), Setting(True, 0)
    with ExitStack() as stacks:
        for name in ("fixed", "adaptive"):
            write_repository(tmp_path / name / "repo")
        fixed = stacks.enter_context(serving(tmp_path / "fixed" / "repo", tmp_path / "fixed", fixed_0))
        learned = stacks.enter_context(serving(tmp_path / "adaptive" / "repo", tmp_path / "adaptive",
                                               adaptive))
        closed_rps(fixed, 64, 1.0)
        closed_rps(learned, 64, 1.0)
        capacity = capacity_rps(fixed, 2.0)
        fixed_near = point(fixed, fixed_0, NEAR, capacity)
        adaptive_near = point(learned, adaptive, NEAR, capacity)
        if adaptive_near.goodput < KEPT_NEAR * fixed_near.goodput:
            # A busy host's API refuses in bursts (the points differ 2x from one run to the
            # next here, either way round): the ordering must hold in one of two rounds.
            fixed_near = point(fixed, fixed_0, NEAR, capacity)
            adaptive_near = point(learned, adaptive, NEAR, capacity)
        past = PAST
        fixed_past = point(fixed, fixed_0, past, capacity)
        for _ in range(2):
            if fixed_past.goodput < 0.9 * fixed_past.offered:
                break
            past *= 1.5  # the host got quicker than the capacity measured: not past it yet
            fixed_past = point(fixed, fixed_0, past, capacity)
        # At 130%: 40% of it or more in 10 runs here; without the API's refusal (api/overload.py)
        # 2-20%. A load raised past 130% (a capacity measured low) leaves less for each.
        held = HELD_PAST * PAST / past
        adaptive_past = point(learned, adaptive, past, capacity)
        if adaptive_past.goodput < held * fixed_near.goodput:
            adaptive_past = point(learned, adaptive, past, capacity)  # a second round, as above
    assert fixed_past.goodput < 0.9 * fixed_past.offered, f"never past capacity: {fixed_past.line()}"
    if fixed_near.goodput < 0.5 * fixed_near.offered:
        # Below capacity, half the load answered late: the host slowed down after measuring
        # its capacity (a throttled machine did, 6x), so no ordering can be read from it.
        pytest.skip(f"the host fell far below its measured capacity: {fixed_near.line()}")
    assert adaptive_near.goodput >= KEPT_NEAR * fixed_near.goodput, (adaptive_near.line(), fixed_near.line())
    assert adaptive_past.goodput >= held * fixed_near.goodput, (adaptive_past.line(), fixed_near.line())
