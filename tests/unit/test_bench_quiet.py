"""bench/quiet.py: between two runs of the sweep, the host is waited for until its CPUs
have been quiet for a few windows on end, or a bound has passed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench import quiet


def readings(busy_per_window: list[int]) -> Iterator[tuple[int, int]]:
    """cpu_times() readings whose windows were busy for these jiffies out of 100."""
    busy, total = 0, 0
    yield busy, total
    for used in busy_per_window:
        busy, total = busy + used, total + 100
        yield busy, total


def test_busy_share_is_the_busy_part_of_the_time_between_two_readings() -> None:
    assert quiet.busy_share((10, 100), (40, 200)) == pytest.approx(0.3)
    assert quiet.busy_share((10, 100), (10, 100)) == 0.0


def test_cpu_times_reads_this_host() -> None:
    busy, total = quiet.cpu_times()
    assert 0 <= busy <= total and total > 0


@pytest.mark.parametrize(("windows", "looks"), [
    ([90, 90, 10, 10, 10, 90], 5),      # two busy, then three quiet on end
    ([10, 10, 90, 10, 10, 10, 90], 6),  # a busy window restarts the count
])
def test_waits_for_quiet_windows_on_end(monkeypatch: pytest.MonkeyPatch, windows: list[int],
                                        looks: int) -> None:
    seen = readings(windows)
    taken: list[int] = []

    def cpu_times() -> tuple[int, int]:
        taken.append(1)
        return next(seen)

    monkeypatch.setattr(quiet, "cpu_times", cpu_times)
    quiet.wait_quiet(60.0, window_s=0.0)
    assert len(taken) == looks + 1  # the first reading, then one per window


def test_gives_up_after_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quiet, "cpu_times", lambda: (0, 0))  # no time passes: never judged
    monkeypatch.setattr(quiet, "busy_share", lambda before, after: 1.0)
    assert quiet.wait_quiet(0.05, window_s=0.01) >= 0.05
