"""bench.sweep's report: every point, the verdict per model and pattern, in Markdown."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from bench.run_report import NCPU

TOLERANCE = 0.02
"""Goodput within this share of the best fixed window counts as a tie (measurement noise)."""
SERVED = 0.99
"""Past the closed-loop capacity, a load where the best fixed window answered this share of
what was offered in time is one the stack still serves: a tie there is met. (A closed loop
of 64 clients keeps 64 requests waiting, so its rate can be below what open-loop arrivals
get answered.)"""


@dataclass(frozen=True)
class Setting:
    adaptive: bool
    delay_us: int
    triton: bool = False
    """NVIDIA Triton's dynamic batcher with this window, not conveyor (bench.sweep --triton)."""

    @property
    def label(self) -> str:
        if self.triton:
            return f"Triton {self.delay_us / 1000:g} ms"
        return "adaptive" if self.adaptive else f"fixed {self.delay_us / 1000:g} ms"


@dataclass
class Point:
    setting: str
    pattern: str
    share: float
    offered: float
    goodput: float
    predicted: float
    p99_ms: float
    ok: int
    late_or_shed: int
    other: int
    gen_cpu: float
    lag_p99_ms: float
    refused: bool
    runs: tuple[float, ...] = ()
    """With ``--repeats``: the goodput of each run of this policy at this point, in the
    order they ran (the point's other figures are its median run's)."""
    overloaded: int = 0
    """Answered 503 (refused: past capacity, or the API behind)."""
    lost: int = 0
    """Sent and never answered (the connection closed, or no answer by the end)."""
    p99_all_ms: float = math.nan
    """p99 of every answer, whatever its status."""

    def line(self) -> str:
        return (f"{self.setting:<12} {self.pattern:<8} {self.share:>5.0%}: offered {self.offered:6.0f} "
                f"goodput {self.goodput:6.0f} (sim {self.predicted:6.0f}) p99 {self.p99_ms:7.1f} ms "
                f"(all {self.p99_all_ms:.1f}) 200/503/504/other/lost {self.ok}/{self.overloaded}/"
                f"{self.late_or_shed}/{self.other}/{self.lost} gen cpu "
                f"{self.gen_cpu:.0%} lag p99 {self.lag_p99_ms:.1f} ms" + (" REFUSED" if self.refused else ""))


def median_run(runs: Sequence[Point]) -> Point:
    """One policy's runs at one pattern and load as one point: the run of median goodput
    among those whose generator kept up (the lower middle one of an even count), carrying
    every run's goodput. Where the generator fell behind in every run, the median of those,
    still refused."""
    kept = [p for p in runs if not p.refused] or list(runs)
    middle = sorted(kept, key=lambda p: p.goodput)[(len(kept) - 1) // 2]
    return replace(middle, runs=tuple(p.goodput for p in runs))


def fmt(value: float, digits: int = 0) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def verdict(points: Sequence[Point], target_ms: float) -> tuple[list[str], bool]:
    """Per pattern and load: adaptive against the best fixed window at that load."""
    lines = ["| pattern | load | adaptive goodput | best fixed (window) | ratio | adaptive p99 ms | "
             "verdict |", "|---|---|---|---|---|---|---|"]
    met = True
    for pattern in dict.fromkeys(p.pattern for p in points):
        for share in dict.fromkeys(p.share for p in points):
            here = [p for p in points if p.pattern == pattern and p.share == share]
            ours = next((p for p in here if p.setting == "adaptive"), None)
            fixed = [p for p in here if p.setting != "adaptive" and not p.refused]
            if ours is None or not fixed:
                continue
            best = max(fixed, key=lambda p: p.goodput)
            ratio = ours.goodput / best.goodput if best.goodput else math.inf
            # Past the closed-loop capacity, strictly more; but where a fixed window still
            # answered nearly all that was offered in time, the load did not exceed what
            # the stack serves, and no policy can answer more than everything.
            past = share > 1.0 and best.goodput < SERVED * best.offered
            ok = ratio > 1.0 if past else ratio >= 1.0 - TOLERANCE
            if share <= 0.8 and not ours.p99_ms <= target_ms:
                ok = False
            if ours.refused:
                text = "refused (generator lag)"
            else:
                text = "met" if ok else "**not met**"
                met = met and ok
            lines.append(f"| {pattern} | {share:.0%} | {fmt(ours.goodput)} | {fmt(best.goodput)} "
                         f"({best.setting}) | {ratio:.3f} | {fmt(ours.p99_ms, 1)} | {text} |")
    return lines, met


def table(points: Sequence[Point]) -> list[str]:
    runs = any(len(p.runs) > 1 for p in points)
    out = ["| policy | pattern | load | offered req/s | goodput req/s | "
           + ("goodput of each run | " if runs else "") + "simulator req/s | p99 ms (200s) | "
           "p99 ms (all) | 200 / 503 / 504 / other / lost | generator CPU | send lag p99 ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if runs else "")]
    return out + [f"| {p.setting} | {p.pattern} | {p.share:.0%} | {fmt(p.offered)} | {fmt(p.goodput)} | "
                  + (" / ".join(fmt(g) for g in p.runs) + " | " if runs else "")
                  + f"{fmt(p.predicted)} | {fmt(p.p99_ms, 1)} | {fmt(p.p99_all_ms, 1)} | "
                  f"{p.ok} / {p.overloaded} / {p.late_or_shed} / {p.other} / {p.lost} | "
                  f"{p.gen_cpu:.0%} | {p.lag_p99_ms:.1f}" + (" (refused)" if p.refused else "") + " |"
                  for p in points]


def report(results: Sequence[dict[str, object]], args: argparse.Namespace, started: datetime,
           load0: str) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    lines = [
        "## Batching policies on the real stack", "",
        f"- date: {started:%Y-%m-%d %H:%M} UTC; load average at start / end: {load0} / "
        + " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        f"- machine: {NCPU} CPUs, {cpu}, Linux {os.uname().release}, Python {sys.version.split()[0]}; "
        "the load generator runs on the same box",
        f"- command: `{' '.join(['python -m bench.sweep', *sys.argv[1:]])}`",
        f"- conveyor as `make run` serves it (`python -m api.serve`, one Celery worker, its own "
        f"redis-server), one stack per policy, all side by side; at each pattern and load the "
        f"policies take turns, in an order rotated from one point to the next; each model's "
        f"`config.yaml` holds only `batching: {{max_queue_delay_us, "
        f"adaptive, latency_target_ms: {args.target_ms:g}}}` (adaptive: max_queue_delay_us 20000, "
        "a bound, not a wait, and `overload` left at its default, `lifo` for a model that "
        "sets its target; the device model's "
        "also declares its tensors: "
        "bench/device_model.py, a batch of n rows sleeps 8 ms + 0.5 ms·n)",
        f"- load: bench.open_loop, keep-alive HTTP/1.1 connections opened in advance (a request "
        "that finds all busy opens one more, beside the send loop), one JSON "
        f"request (one row) encoded once, `parameters.timeout` = {args.timeout_ms:g} ms; "
        f"{args.warmup_s:g} s warm-up then {args.point_s:g} s measured per point; latency from the "
        f"scheduled send time; goodput = 200s within {args.target_ms:g} ms per second; a point whose "
        f"send lag p99 exceeds {args.max_lag_ms:g} ms is refused",
        "- on-off: 100 ms of Poisson arrivals at twice the rate, then 100 ms silent (same mean)",
        *(["- Triton: NVIDIA Triton 2.51 (nvidia-pytriton 0.7.0, bench/.triton-venv) serving the "
           "same ONNX file in its Python backend with onnxruntime (bench/triton.py), its dynamic "
           "batcher with the first fixed window and `default_queue_policy { timeout_action: "
           f"REJECT, default_timeout_microseconds: {args.target_ms * 1000:g}, "
           "allow_timeout_override: false }`: its best queue timeout for answers within the "
           "target"] if args.triton else []),
        *([f"- repeats: {args.repeats} rounds per pattern and load, every policy once per round "
           "(the order rotated from round to round); a policy's point is its run of median "
           "goodput among those whose generator kept up, with every run's goodput beside it: "
           "so the best fixed window is the best of the windows' medians, not the luckiest of "
           "their single runs"] if args.repeats > 1 else []),
        *([f"- slices: each run of a policy at a point is {args.slices} slices of "
           f"{args.warmup_s:g} s warm-up and {args.point_s:g} s measured, the policies taking "
           "turns slice by slice (order rotated), every policy given the same arrivals in its "
           "k-th slice; the slices' requests are pooled into one point, so every policy meets "
           "the same drift of the host's speed"] if args.slices > 1 else []),
        "- simulator: bench.scheduler_sim.run_loop with the same send times, a device with the "
        "whole-path batch time the adaptive policy learned on the real stack, the same policy, "
        "and the fixed path outside the worker (c=1 latency − t(1)) added to each answer", "",
    ]
    for result in results:
        points = result["points"]
        assert isinstance(points, list)
        rows, met = verdict(points, args.target_ms)
        a, b, path_s = (float(str(result[k])) for k in ("a", "b", "path_s"))
        lines += [
            f"### {result['model']}", "",
            "Capacity (closed loop, the most of 64 and 256 connections on the adaptive stack and "
            "the first fixed window's): "
            f"{float(str(result['capacity'])):,.0f} req/s. "
            f"Learned whole-path batch time t(n) = {a * 1e3:.2f} ms + {b * 1e3:.3f} ms·n; "
            f"fixed path outside the worker {path_s * 1e3:.2f} ms.", "",
            "Adaptive against the best fixed window at each load (ties within "
            f"{TOLERANCE:.0%} count as met below capacity; above it, strictly more, unless "
            f"the best fixed window answered at least {SERVED:.0%} of what was offered in "
            "time, which no policy can beat by more than noise):", "",
            *rows, "", f"Verdict: **{'met' if met else 'not met'}**.", "",
            "Every point:", "", *table(points), "",
        ]
    return "\n".join(lines)
