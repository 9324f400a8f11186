"""The batching sweep's verdict (bench/sweep_report.py): past the closed-loop capacity the
adaptive policy must answer strictly more in time than the best fixed window, unless that
window answered nearly everything offered; with repeats, each policy is judged by its run of
median goodput."""

from __future__ import annotations

from dataclasses import replace

from bench.sweep_report import Point, median_run, verdict


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


def test_repeated_runs_are_judged_by_their_median_not_their_luckiest() -> None:
    fixed = [at("fixed 0 ms", 0.7, 800, g) for g in (800, 560, 610)]
    adaptive = [at("adaptive", 0.7, 800, g) for g in (640, 600, 790)]
    # One run each, the luckiest fixed window beats the adaptive policy's typical run ...
    assert not verdict([adaptive[0], fixed[0]], 50.0)[1]
    # ... by their medians the adaptive policy is ahead (640 against 610).
    ours, theirs = median_run(adaptive), median_run(fixed)
    assert (ours.goodput, theirs.goodput) == (640, 610)
    assert ours.runs == (640, 600, 790) and theirs.runs == (800, 560, 610)
    assert verdict([ours, theirs], 50.0)[1]


def test_runs_where_the_generator_fell_behind_do_not_count_toward_the_median() -> None:
    runs = [at("adaptive", 0.7, 800, 790), replace(at("adaptive", 0.7, 800, 100), refused=True),
            at("adaptive", 0.7, 800, 780)]
    kept = median_run(runs)
    assert kept.goodput == 780 and not kept.refused and kept.runs == (790, 100, 780)
    every = median_run([replace(p, refused=True) for p in runs])
    assert every.refused and every.goodput == 780
    alone = median_run(runs[:1])  # one run (no --repeats): the point as it was measured
    assert alone == replace(runs[0], runs=(790,))
