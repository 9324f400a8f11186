"""bench.sweep's turns: with slices, every policy runs once per slice, in an order rotated
from slice to slice, so no policy always runs first (after another's load) or last."""

from __future__ import annotations

from bench.sweep import schedule
from bench.sweep_report import Setting

POLICIES = [Setting(True, 0), Setting(False, 0), Setting(False, 2000)]


def test_one_slice_is_one_turn_each_rotated_by_the_turn() -> None:
    assert schedule(POLICIES, 1, 0) == [(0, p) for p in POLICIES]
    assert schedule(POLICIES, 1, 1) == [(0, POLICIES[1]), (0, POLICIES[2]), (0, POLICIES[0])]


def test_slices_interleave_the_policies_and_rotate_who_goes_first() -> None:
    order = schedule(POLICIES, 3, 0)
    assert [index for index, _ in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for index in range(3):
        ran = [policy for at, policy in order if at == index]
        assert sorted(ran, key=POLICIES.index) == POLICIES
    assert [order[3 * index][1] for index in range(3)] == POLICIES
