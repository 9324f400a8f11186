"""The simulator's scenarios: which policies and servers it compares, on which devices
and traces, and the report ``python -m bench.simulate`` writes into docs/batching.md."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batching.adaptive import AdaptivePolicy
from batching.policy import FixedWindow, Policy
from bench.peer_batchers import LitServeWindow, run_cork
from bench.scheduler_sim import (
    KNEE,
    LINEAR,
    MLP_MEDIUM_CPU,
    ClosedStream,
    Device,
    Outcome,
    run_loop,
    traces,
)


@dataclass(frozen=True, slots=True)
class Scenario:
    device: Device
    max_rows: int = 64
    target_s: float = 0.025
    adaptive_bound_s: float = 0.02
    """The adaptive policy's ``max_queue_delay_us``: a bound, not a wait."""


Runner = Callable[[Sequence[float], Scenario], Outcome]
MakePolicy = Callable[[Scenario], Policy]

LOOP_POLICIES: dict[str, MakePolicy] = {
    "fixed 0": lambda s: FixedWindow(s.max_rows, 0.0),
    "fixed 100 µs": lambda s: FixedWindow(s.max_rows, 0.0001),
    "fixed 1 ms": lambda s: FixedWindow(s.max_rows, 0.001),
    "fixed 5 ms": lambda s: FixedWindow(s.max_rows, 0.005),
    "Ray Serve 10 ms": lambda s: FixedWindow(s.max_rows, 0.01),
    "LitServe 10 ms": lambda s: LitServeWindow(s.max_rows, 0.01),
    "fixed 20 ms": lambda s: FixedWindow(s.max_rows, 0.02),
    "adaptive": lambda s: AdaptivePolicy(s.max_rows, s.adaptive_bound_s, latency_target_s=s.target_s),
}
"""Policies run in the model of our inference loop. Ray Serve's ``@serve.batch`` times its
wait from the first request it takes, as Triton does, so it is a fixed window here (its
defaults: ``batch_wait_timeout_s=0.01``, ``max_batch_size=10``; every contender gets the
scenario's ``max_rows``). LitServe's ``batch_timeout`` (default 0) is set to 10 ms."""


def _loop(name: str) -> Runner:
    make = LOOP_POLICIES[name]
    return lambda arrivals, s: run_loop(arrivals, s.device, make(s), s.max_rows)


CONTENDERS: dict[str, Runner] = {
    **{name: _loop(name) for name in ("fixed 0", "fixed 100 µs", "fixed 1 ms", "fixed 5 ms",
                                       "Ray Serve 10 ms", "LitServe 10 ms")},
    "CORK": lambda arrivals, s: run_cork(arrivals, s.device, s.max_rows, s.target_s),
    "adaptive": _loop("adaptive"),
}
FIXED = ("fixed 0", "fixed 100 µs", "fixed 1 ms", "fixed 5 ms")


@dataclass(frozen=True, slots=True)
class Result:
    device: str
    trace: str
    policy: str
    goodput: float
    """Share of offered requests answered within the target."""
    p50_s: float
    p99_s: float
    """Of answered requests."""
    throughput: float
    """Answered rows per second."""
    mean_batch: float
    dropped: int

    @property
    def meets_target(self) -> bool:
        """p99 of all offered requests (unanswered ones count as late) within the target."""
        return self.goodput >= 0.99


def _result(device: str, trace: str, policy: str, outcome: Outcome, target_s: float) -> Result:
    answered = len(outcome.latency) - outcome.dropped
    return Result(device, trace, policy, outcome.goodput(target_s), outcome.percentile(50),
                  outcome.percentile(99), answered / outcome.span_s if outcome.span_s else 0.0,
                  outcome.mean_batch, outcome.dropped)


def evaluate(scenario: Scenario, duration_s: float = 2.0, seed: int = 0,
             policies: Sequence[str] = tuple(CONTENDERS)) -> list[Result]:
    """Every policy on every trace (open loop: arrivals do not wait for answers)."""
    results = []
    for trace in traces(scenario.device.capacity(scenario.max_rows), duration_s, seed):
        for name in policies:
            outcome = CONTENDERS[name](trace.arrivals, scenario)
            results.append(_result(scenario.device.name, trace.name, name, outcome, scenario.target_s))
    return results


def evaluate_closed(scenario: Scenario, clients: Sequence[int] = (1, 4, 16, 64),
                    overhead_s: float = 0.001, duration_s: float = 2.0,
                    policies: Sequence[str] = ("fixed 0", "fixed 20 ms", "adaptive")) -> list[Result]:
    """Closed loop, as a benchmark client drives it: each of ``clients`` sends its next request
    ``overhead_s`` (API and network, outside the inference process) after its last answer."""
    results = []
    for count in clients:
        for name in policies:
            stream = ClosedStream(count, overhead_s, duration_s)
            policy = LOOP_POLICIES[name](scenario)
            outcome = run_loop(stream, scenario.device, policy, scenario.max_rows)
            label = f"{count} client" + ("s" if count != 1 else "")
            results.append(_result(scenario.device.name, label, name, outcome, scenario.target_s))
    return results


def _header(scenario: Scenario) -> str:
    device = scenario.device
    return (f"**{device.name}**: {device.describe()}; capacity "
            f"{device.capacity(scenario.max_rows):.0f} rows/s; max batch {scenario.max_rows}; "
            f"target {scenario.target_s * 1e3:g} ms; adaptive bound "
            f"(`max_queue_delay_us`) {scenario.adaptive_bound_s * 1e6:.0f}.")


def _grid(results: Sequence[Result], cell: Callable[[Result], str], corner: str) -> list[str]:
    names = list(dict.fromkeys(r.policy for r in results))
    rows = list(dict.fromkeys(r.trace for r in results))
    by = {(r.trace, r.policy): r for r in results}
    lines = [f"| {corner} | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(cell(by[(row, name)]) for name in names) + " |")
    return lines


def markdown(scenario: Scenario, results: Sequence[Result]) -> str:
    """A row per trace, a column per policy; cells ``goodput % / p99 ms (mean batch)``."""
    def cell(r: Result) -> str:
        mark = "†" if r.dropped else ""
        return f"{r.goodput * 100:.1f}{mark} / {r.p99_s * 1e3:.1f} ({r.mean_batch:.0f})"

    return "\n".join([_header(scenario), "", *_grid(results, cell, "trace")])


def markdown_closed(scenario: Scenario, results: Sequence[Result], overhead_s: float) -> str:
    """A row per client count; cells ``p50 ms / rows/s (mean batch)``."""
    def cell(r: Result) -> str:
        return f"{r.p50_s * 1e3:.1f} / {r.throughput:.0f} ({r.mean_batch:.1f})"

    return "\n".join([_header(scenario) + f" Overhead outside the worker {overhead_s * 1e3:g} ms.",
                      "", *_grid(results, cell, "closed loop")])


OPEN_SCENARIOS = (Scenario(LINEAR), Scenario(KNEE))
CLOSED_SCENARIO = Scenario(MLP_MEDIUM_CPU, target_s=0.05)


def report(duration_s: float = 2.0, seed: int = 0) -> str:
    """The tables of ``docs/batching.md``."""
    parts = []
    for scenario in OPEN_SCENARIOS:
        parts.append(markdown(scenario, evaluate(scenario, duration_s, seed)))
    overhead = 0.001
    parts.append(markdown_closed(CLOSED_SCENARIO,
                                 evaluate_closed(CLOSED_SCENARIO, overhead_s=overhead,
                                                 duration_s=duration_s), overhead))
    return "\n\n".join(parts) + "\n"
