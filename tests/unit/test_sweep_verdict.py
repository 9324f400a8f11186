"""The batching sweep's verdict (bench/sweep_report.py): past the closed-loop capacity the
adaptive policy must answer strictly more in time than the best fixed window, unless that
window answered nearly everything offered."""

from __future__ import annotations

from bench.sweep_report import Point, verdict


def at(setting: str, share: float, offered: float, goodput: float) -> Point:
    return Point(setting=setting, pattern="poisson", share=share, offered=offered,
                 goodput=goodput, predicted=goodput, p99_ms=30.0, ok=int(goodput), late_or_shed=0,
                 other=0, gen_cpu=0.05, lag_p99_ms=1.0, refused=False)


def test_past_capacity_a_tie_is_met_only_where_the_fixed_window_answered_nearly_all() -> None:
    served = [at("adaptive", 1.1, 800, 795), at("fixed 0 ms", 1.1, 800, 797)]
    lines, met = verdict(served, 50.0)
    assert met and lines[-1].endswith("| met |")
    short = [at("adaptive", 1.1, 800, 640), at("fixed 0 ms", 1.1, 800, 640)]
    lines, met = verdict(short, 50.0)
    assert not met and lines[-1].endswith("| **not met** |")
    ahead = [at("adaptive", 1.1, 800, 700), at("fixed 0 ms", 1.1, 800, 640)]
    assert verdict(ahead, 50.0)[1]
