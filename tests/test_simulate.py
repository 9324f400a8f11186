"""The batching simulator, and what it shows about the adaptive policy."""

from pathlib import Path

import pytest

from batching.policy import FixedWindow
from bench.peer_batchers import LitServeWindow, run_cork
from bench.scheduler_sim import KNEE, LINEAR, ClosedStream, Device, poisson, run_loop, traces
from bench.sim_scenarios import (
    CLOSED_SCENARIO,
    CONTENDERS,
    FIXED,
    OPEN_SCENARIOS,
    Result,
    Scenario,
    evaluate,
    evaluate_closed,
    report,
)
from bench.simulate import BEGIN, END, write_into

TOLERANCE = 0.01
"""Goodput the adaptive policy may give up against the best fixed window (noise)."""


@pytest.fixture(scope="module", params=[0, 1], ids=["seed0", "seed1"])
def open_results(request: pytest.FixtureRequest) -> list[Result]:
    return [r for s in OPEN_SCENARIOS for r in evaluate(s, seed=request.param)]


def by_trace(results: list[Result]) -> dict[tuple[str, str], dict[str, Result]]:
    out: dict[tuple[str, str], dict[str, Result]] = {}
    for r in results:
        out.setdefault((r.device, r.trace), {})[r.policy] = r
    return out


def test_adaptive_goodput_matches_the_best_fixed_window_on_every_trace(
        open_results: list[Result]) -> None:
    for (device, trace), row in by_trace(open_results).items():
        best = max(row[name].goodput for name in FIXED)
        assert row["adaptive"].goodput >= best - TOLERANCE, (device, trace, best, row["adaptive"])


def test_adaptive_meets_the_target_wherever_any_policy_can(open_results: list[Result]) -> None:
    reachable = 0
    for (device, trace), row in by_trace(open_results).items():
        if any(r.meets_target for r in row.values()):
            reachable += 1
            assert row["adaptive"].meets_target, (device, trace, row["adaptive"])
    assert reachable >= 10  # the comparison is not vacuous


def test_fixed_windows_cost_latency_at_low_load(open_results: list[Result]) -> None:
    for device in (LINEAR.name, KNEE.name):
        row = by_trace(open_results)[(device, "poisson 10%")]
        assert row["fixed 5 ms"].p99_s > row["fixed 0"].p99_s + 0.004
        assert row["adaptive"].p99_s < row["fixed 0"].p99_s + 0.0005


def test_closed_loop_no_window_wait_alone_and_full_batches_under_load() -> None:
    results = evaluate_closed(CLOSED_SCENARIO, clients=(1, 4, 64), duration_s=1.0)
    row = {(r.trace, r.policy): r for r in results}
    alone = row[("1 client", "adaptive")]
    batch_1 = CLOSED_SCENARIO.device.seconds(1)
    assert alone.p50_s == pytest.approx(batch_1, abs=0.0005)  # despite a 20 ms bound
    assert row[("1 client", "fixed 20 ms")].p50_s > batch_1 + 0.015
    assert row[("64 clients", "adaptive")].mean_batch >= 16
    for clients in ("1 client", "4 clients", "64 clients"):
        assert (row[(clients, "adaptive")].throughput
                >= 0.99 * row[(clients, "fixed 0")].throughput), clients
    assert row[("4 clients", "adaptive")].throughput > 1.2 * row[("4 clients", "fixed 0")].throughput


def test_the_simulation_is_deterministic() -> None:
    scenario = Scenario(LINEAR)
    once = evaluate(scenario, duration_s=0.5, seed=3, policies=("fixed 1 ms", "adaptive", "CORK"))
    again = evaluate(scenario, duration_s=0.5, seed=3, policies=("fixed 1 ms", "adaptive", "CORK"))
    assert once == again


def test_traces_hit_their_rates() -> None:
    by_name = {t.name: t for t in traces(1000.0, duration_s=2.0)}
    assert set(by_name) == {"poisson 10%", "poisson 30%", "poisson 50%", "poisson 70%",
                            "poisson 85%", "poisson 95%", "bursts", "on/off"}
    assert len(by_name["poisson 50%"].arrivals) == pytest.approx(1000, rel=0.1)
    assert len(by_name["on/off"].arrivals) == pytest.approx(900, rel=0.1)
    for trace in by_name.values():
        assert list(trace.arrivals) == sorted(trace.arrivals)


def test_device_curves() -> None:
    assert LINEAR.seconds(10) == pytest.approx(0.002 + 0.0015)
    assert KNEE.seconds(1) == KNEE.seconds(32) == 0.004
    assert KNEE.seconds(64) == pytest.approx(0.0072)
    measured = Device("m", points=((1, 0.001), (4, 0.004), (8, 0.006)))
    assert measured.seconds(2) == pytest.approx(0.002)
    assert measured.seconds(6) == pytest.approx(0.005)
    assert measured.seconds(16) == pytest.approx(0.010)
    assert LINEAR.capacity(64) == pytest.approx(64 / 0.0116)


def test_the_loop_reads_at_most_max_rows_and_runs_fifo() -> None:
    arrivals = [0.0] * 10
    out = run_loop(arrivals, LINEAR, FixedWindow(4, 0.0), 4)
    assert out.batches == [4, 4, 2]
    assert out.dropped == 0
    assert sorted(out.latency) == pytest.approx(sorted(
        [LINEAR.seconds(4)] * 4 + [2 * LINEAR.seconds(4)] * 4
        + [2 * LINEAR.seconds(4) + LINEAR.seconds(2)] * 2))


def test_expired_requests_are_never_run() -> None:
    out = run_loop([0.0] * 3, Device("slow", 1.0), FixedWindow(1, 0.0), 1, timeout_s=1.5)
    assert out.batches == [1, 1]
    assert out.dropped == 1


def test_a_window_waits_from_the_first_read() -> None:
    out = run_loop([0.0, 0.0005], LINEAR, FixedWindow(64, 0.002), 64)
    assert out.batches == [2]
    assert out.latency.max() == pytest.approx(0.002 + LINEAR.seconds(2), abs=1e-6)


def test_litserve_windows_start_when_the_last_one_ended() -> None:
    window = LitServeWindow(64, 0.01)
    window.observe_batch(3, 0.004, 1.0)
    assert window.decide(1.013, 1, 1.013, 30.0).wait_s == pytest.approx(0.007)
    assert window.decide(1.02, 1, 1.013, 30.0).reason == "window"


def test_closed_loop_clients_send_again_after_each_answer() -> None:
    stream = ClosedStream(2, overhead_s=0.001, duration_s=0.1)
    out = run_loop(stream, LINEAR, FixedWindow(64, 0.0), 64)
    # Two clients out of step ping-pong: each returns while the other's batch of 1 runs.
    assert set(out.batches) == {1}
    assert len(out.latency) == pytest.approx(0.1 / LINEAR.seconds(1), rel=0.1)


def test_cork_serves_a_lone_request_and_sheds_in_overload() -> None:
    alone = run_cork([0.5], LINEAR, 64, 0.025)
    assert alone.latency.tolist() == [pytest.approx(LINEAR.seconds(1))]
    rng = __import__("numpy").random.default_rng(0)
    flood = poisson(rng, 3 * LINEAR.capacity(64), 0.0, 0.5)
    out = run_cork(flood, LINEAR, 64, 0.025)
    assert out.dropped > 0
    assert max(out.batches) <= 63  # BentoML takes fewer than max_batch_size


def test_every_contender_runs_every_trace() -> None:
    scenario = Scenario(KNEE)
    for trace in traces(KNEE.capacity(64), duration_s=0.2):
        for name, run in CONTENDERS.items():
            out = run(trace.arrivals, scenario)
            assert len(out.latency) == len(trace.arrivals), (name, trace.name)


def test_report_goes_between_the_markers(tmp_path: Path) -> None:
    doc = tmp_path / "batching.md"
    doc.write_text(f"intro\n{BEGIN}\nold table\n{END}\noutro\n")
    write_into(doc, "| new |\n")
    assert doc.read_text() == f"intro\n{BEGIN}\n| new |\n{END}\noutro\n"
    text = report(duration_s=0.2)
    assert text.count("| trace |") == 2 and "| closed loop |" in text
