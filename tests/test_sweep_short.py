"""The batching sweep, short: the adaptive policy against a fixed window of 0 on the real
stack (API, Redis, a Celery worker), at a load below capacity and one past it
(bench/RESULTS-batching.md has the full sweep on the MLPs: python -m bench.sweep).

The model is a device (bench/device_model.py): each batch of ``n`` rows takes 8 ms +
0.5 ms·n and no CPU (it sleeps, as a process waits on a GPU). The MLPs of the full sweep
share the two cores of a CI host with the API, and past capacity there the API process,
not the policy, decides the goodput: one point of either policy collapsed where the next
one, of the same stack at the same rate, held (goodput 0 to 1,000 req/s at 2,000
offered), and in CI three rounds in a row of the fixed window came out ahead by that noise
alone (0.3-0.7x, the adaptive stack's API refusing more). A device that leaves the cores
to the API measures what the policy decides: which rows run, and which are answered early
because they can no longer make it.

Below capacity every policy answers nearly everything in time, so the adaptive policy must
not lose more than noise. Past capacity it must be well above the fixed window (``GAIN``),
whose queue fills with requests that run once they can no longer make it: measured here,
136-166 answers in time a second against the adaptive policy's 803, at 996 offered (with
the test's processes held to 0.6 of a core by a cgroup quota, 3 against 690 at 1,191).
The capacity is measured first (a closed loop of 64 clients on the adaptive stack); both
stacks run side by side (the idle one costs next to nothing), their points alternate, the
order swapped from one round to the next, and each ordering must hold in one of
``ROUNDS`` rounds. The fixed window proves the "past" load is past capacity (it left at
least a tenth of what was offered late or unanswered); when it did not, the load is
raised.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import pytest

from bench import device_model
from bench.scheduler_sim import Device
from bench.sweep import Stack, closed_rps, conveyor, measure, request_body, write_config
from bench.sweep_report import Point, Setting

pytestmark = pytest.mark.serial

MODEL = device_model.NAME
TARGET_MS = 50.0
NEAR, PAST = 0.8, 1.3
ROUNDS = 3
"""Rounds of one point per stack, at most, for each ordering to hold in one of them."""
KEPT = 0.9
"""Below capacity, the adaptive policy's goodput is at least this share of the fixed window's."""
GAIN = 1.5
"""Past capacity, it is at least this many times the fixed window's: more than a tie that
noise could tip (5-6x measured on a 2-core host; 200x held to 0.6 of a core)."""
ARGS = argparse.Namespace(point_s=3.0, warmup_s=1.0, target_ms=TARGET_MS, timeout_ms=TARGET_MS,
                          max_lag_ms=1e9)
DEVICE = Device("unused", 0.001)
FIXED, ADAPTIVE = Setting(False, 0), Setting(True, 0)


def serving(work: Path, setting: Setting) -> AbstractContextManager[Stack]:
    """A stack serving the device model, batched by ``setting``."""
    device_model.write(work / "repo")
    write_config(work / "repo", MODEL, setting, TARGET_MS)
    return conveyor(MODEL, work / "repo", work, request_body(MODEL, int(TARGET_MS * 1000)))


def point(stack: Stack, setting: Setting, share: float, capacity: float) -> Point:
    return measure(stack, setting, "poisson", share, capacity, ARGS, DEVICE, 0.0)


def rounds(fixed: Stack, learned: Stack, share: float, capacity: float,
           holds: Callable[[Point, Point], bool]) -> tuple[Point, Point]:
    """(fixed, adaptive) points at ``share`` of ``capacity``, round after round, until
    ``holds`` them or ``ROUNDS`` rounds are spent: the last round's points."""
    for index in range(ROUNDS):
        if index % 2:
            adaptive_point = point(learned, ADAPTIVE, share, capacity)
            fixed_point = point(fixed, FIXED, share, capacity)
        else:
            fixed_point = point(fixed, FIXED, share, capacity)
            adaptive_point = point(learned, ADAPTIVE, share, capacity)
        if holds(fixed_point, adaptive_point):
            break
    return fixed_point, adaptive_point


def past_rounds(fixed: Stack, learned: Stack, capacity: float) -> tuple[Point, Point]:
    """(fixed, adaptive) points past capacity, round after round, until the adaptive policy
    keeps ``GAIN`` times the fixed window's goodput or ``ROUNDS`` rounds are spent. A round
    whose fixed window still answered 90% of the load in time was not past capacity (the
    host got quicker than the capacity measured): it does not count, and the load rises
    1.5 times, twice at most."""
    share, raised, judged = PAST, 0, 0
    while True:
        if (raised + judged) % 2:
            adaptive_point = point(learned, ADAPTIVE, share, capacity)
            fixed_point = point(fixed, FIXED, share, capacity)
        else:
            fixed_point = point(fixed, FIXED, share, capacity)
            adaptive_point = point(learned, ADAPTIVE, share, capacity)
        if fixed_point.goodput >= 0.9 * fixed_point.offered and raised < 2:
            share, raised = share * 1.5, raised + 1
            continue
        judged += 1
        if adaptive_point.goodput >= GAIN * fixed_point.goodput or judged >= ROUNDS:
            return fixed_point, adaptive_point


def test_adaptive_ties_below_capacity_and_keeps_up_past_it(tmp_path: Path) -> None:
    with ExitStack() as stacks:
        fixed = stacks.enter_context(serving(tmp_path / "fixed", FIXED))
        learned = stacks.enter_context(serving(tmp_path / "adaptive", ADAPTIVE))
        # A fresh API process refuses a closed loop at its capacity for its first seconds (a
        # cold start's lag, with answers taking nearly the timeout); warmed up, none.
        closed_rps(fixed, 64, 2.0)
        closed_rps(learned, 64, 2.0)
        capacity = closed_rps(learned, 64, 2.0)[0]
        fixed_near, adaptive_near = rounds(
            fixed, learned, NEAR, capacity, lambda f, a: a.goodput >= KEPT * f.goodput)
        fixed_past, adaptive_past = past_rounds(fixed, learned, capacity)
    assert fixed_past.goodput < 0.9 * fixed_past.offered, f"never past capacity: {fixed_past.line()}"
    if fixed_near.goodput < 0.5 * fixed_near.offered:
        # Below capacity, half the load answered late: the host slowed down after measuring
        # its capacity (a throttled machine did, 6x), so no ordering can be read from it.
        pytest.skip(f"the host fell far below its measured capacity: {fixed_near.line()}")
    assert adaptive_near.goodput >= KEPT * fixed_near.goodput, (adaptive_near.line(), fixed_near.line())
    assert adaptive_past.goodput >= GAIN * fixed_past.goodput, (adaptive_past.line(), fixed_past.line())
