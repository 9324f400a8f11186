"""The adaptive batching policy and the fixed window, driven by an injected clock."""

import pytest

from batching.adaptive import AdaptivePolicy, ArrivalRate, LatencyModel
from batching.config import BatchingConfig, ModelConfig
from batching.policy import Decision, FixedWindow, Policy
from batching.policy_choice import make_policy

NOW = 1_000.0
FAR = NOW + 30.0  # the default 30 s deadline: never the binding constraint here


def taught(a: float = 0.005, b: float = 0.00005, rate: float = 5000.0, *, until: float = NOW,
           bound_s: float = 0.02, target_s: float = 0.05, **kw: object) -> AdaptivePolicy:
    """A policy that has seen batches of t(n) = a + b·n and ``rate`` rows/s until ``until``."""
    policy = AdaptivePolicy(64, bound_s, latency_target_s=target_s, **kw)  # type: ignore[arg-type]
    for i, rows in enumerate([1, 1, 2, 4, 8, 16, 32, 64, 3, 12, 40, 6]):
        policy.observe_batch(rows, a + b * rows, until - 5.0 + i * 0.1)
    count = int(rate * 0.5)
    for i in range(count):
        policy.observe_arrivals(1, until - 0.5 + (i + 1) * 0.5 / count)
    return policy


def test_a_fresh_policy_dispatches_at_once() -> None:
    policy = AdaptivePolicy(64, max_delay_s=0.02)
    decision = policy.decide(NOW, 1, NOW, FAR)
    assert decision.dispatch and decision.reason == "policy"


def test_low_load_dispatches_at_once_despite_a_long_bound() -> None:
    policy = taught(a=0.002, b=0.0001, rate=50.0)
    decision = policy.decide(NOW, 1, NOW, FAR)
    assert decision == Decision(True, reason="policy")


def test_under_load_a_lone_row_waits_for_company() -> None:
    policy = taught()  # n* = 5000·0.005 / (1 − 5000·0.00005) ≈ 33 rows
    decision = policy.decide(NOW, 1, NOW, FAR)
    assert not decision.dispatch
    assert 0.0 < decision.wait_s <= 0.02


@pytest.mark.parametrize(("b", "rate"), [
    (0.0002, 5000.0),  # λ·b = 1: no batch size keeps up
    (0.0001, 6000.0),  # n* = 6000·0.005 / (1 − 0.6) = 75 rows, more than max_batch_size
])
def test_past_what_full_batches_keep_up_with_nothing_waits(b: float, rate: float) -> None:
    # Even batches of max_batch_size fall behind: the queue grows while a batch runs, so
    # the next is as big as it can be without waiting, and a wait would only idle the
    # device (on mlp_medium past capacity, a quarter of the answers went late waiting for
    # 42 rows).
    policy = taught(b=b, rate=rate)
    assert policy.goal_rows(policy.arrivals.rate(NOW), 64) == 64.0
    assert policy.decide(NOW, 1, NOW, FAR) == Decision(True, reason="policy")
    assert policy.decide(NOW, 20, NOW, FAR) == Decision(True, reason="policy")


def test_under_load_enough_rows_go() -> None:
    policy = taught()
    assert policy.decide(NOW, 30, NOW - 0.002, FAR) == Decision(True, reason="policy")


def test_the_bound_ends_every_wait() -> None:
    policy = taught()
    assert policy.decide(NOW, 1, NOW - 0.02, FAR).reason == "window"
    nearly = policy.decide(NOW, 1, NOW - 0.0195, FAR)
    assert not nearly.dispatch and nearly.wait_s <= 0.0005 + 1e-12


def test_a_zero_bound_never_waits() -> None:
    policy = taught(bound_s=0.0)
    assert policy.decide(NOW, 1, NOW, FAR) == Decision(True, reason="window")


def test_the_latency_target_ends_a_wait() -> None:
    policy = taught(target_s=0.012)  # budget 0.8·12 ms; t(n) ≥ 5 ms
    assert not policy.decide(NOW, 1, NOW, FAR).dispatch
    assert policy.decide(NOW, 1, NOW - 0.005, FAR).reason == "deadline"


def test_a_close_deadline_ends_a_wait() -> None:
    policy = taught()
    assert not policy.decide(NOW, 1, NOW, NOW + 0.01).dispatch
    assert policy.decide(NOW, 1, NOW, NOW + 0.005).reason == "deadline"


def test_rows_read_just_after_a_batch_count_its_duration() -> None:
    # budget 0.8·20 = 16 ms; the last batch (64 rows) took t(64) = 8.2 ms
    idle = taught(target_s=0.02)
    idle.observe_batch(64, 0.0082, NOW - 0.02)
    assert not idle.decide(NOW, 1, NOW - 0.003, FAR).dispatch  # read while idle: 3 ms old
    after = taught(target_s=0.02)
    after.observe_batch(64, 0.0082, NOW - 0.003)
    # Read as that batch ended: it may have queued through it, 11.2 ms old already.
    assert after.decide(NOW, 1, NOW - 0.003, FAR).reason == "deadline"


def test_waiting_stops_when_arrivals_stop() -> None:
    policy = taught(until=NOW - 0.01)  # nothing for 10 ms: the rate is at most 100/s
    assert policy.decide(NOW, 1, NOW - 0.001, FAR) == Decision(True, reason="policy")


def test_row_cap_bounds_the_batch() -> None:
    policy = taught(a=0.002, b=0.0001, rate=50.0)
    policy.row_cap = 8
    assert policy.decide(NOW, 8, NOW, FAR) == Decision(True, reason="full", max_rows=8)
    assert policy.decide(NOW, 20, NOW, FAR) == Decision(True, reason="full", max_rows=8)
    assert policy.decide(NOW, 3, NOW, FAR) == Decision(True, reason="policy", max_rows=8)
    assert policy.estimates()["row_cap"] == 8.0
    policy.row_cap = None
    assert policy.decide(NOW, 20, NOW, FAR) == Decision(True, reason="policy")


def test_max_batch_size_is_full() -> None:
    assert taught().decide(NOW, 64, NOW, FAR) == Decision(True, reason="full")


def test_a_ready_preferred_size_goes_at_low_load() -> None:
    policy = taught(a=0.002, b=0.0001, rate=50.0, preferred=(8, 16))
    assert policy.decide(NOW, 10, NOW, FAR) == Decision(True, reason="policy", max_rows=8)
    assert policy.decide(NOW, 5, NOW, FAR) == Decision(True, reason="policy")


def test_under_load_the_next_preferred_size_is_awaited_when_in_reach() -> None:
    policy = taught(preferred=(8, 48))
    waiting = policy.decide(NOW, 9, NOW, FAR)
    assert not waiting.dispatch
    assert waiting.wait_s == pytest.approx((48 - 9) / policy.arrivals.rate(NOW))


def test_under_load_a_preferred_size_goes_when_the_next_is_out_of_reach() -> None:
    policy = taught(preferred=(8, 48), target_s=0.014)  # 11.2 ms: no time to gather 48 rows
    assert policy.decide(NOW, 9, NOW, FAR) == Decision(True, reason="full", max_rows=8)


def test_estimates_report_what_was_learned() -> None:
    policy = taught(a=0.003, b=0.0002, rate=2000.0)
    est = policy.estimates()
    assert set(est) == {"arrival_rate_per_s", "latency_a_s", "latency_b_s_per_row", "row_cap",
                        "shed_reserve_s"}
    assert est["latency_a_s"] == pytest.approx(0.003, rel=1e-3)
    assert est["latency_b_s_per_row"] == pytest.approx(0.0002, rel=1e-3)
    assert est["arrival_rate_per_s"] == pytest.approx(2000.0, rel=0.05)
    assert est["row_cap"] == 64.0
    assert est["shed_reserve_s"] == pytest.approx(0.3 * policy.latency_target_s)  # no API reported


def test_latency_fit_skips_warm_up_and_clips_outliers() -> None:
    model = LatencyModel()
    model.observe(1, 2.0)  # first calls: compilation, lazy allocation
    model.observe(1, 1.0)
    for rows in [1, 4, 16, 64, 2, 8, 32, 48, 24, 12]:
        model.observe(rows, 0.001 + 0.0001 * rows)
    model.observe(8, 5.0)  # a pause
    assert model.a == pytest.approx(0.001, abs=0.003)
    assert model.predict(64) < 0.05


def test_one_batch_size_gives_a_flat_fit() -> None:
    model = LatencyModel(skip=0)
    for _ in range(5):
        model.observe(1, 0.004)
    assert model.a == pytest.approx(0.004)
    assert model.b == 0.0


def test_arrival_rate_tracks_clumps_and_gaps() -> None:
    rate = ArrivalRate()
    assert rate.rate(NOW) == 0.0
    for i in range(100):  # 20 rows every 10 ms: 2000 rows/s, read in clumps
        rate.observe(20, NOW + i * 0.01)
    last = NOW + 0.99
    assert rate.rate(last) == pytest.approx(2000.0, rel=0.15)
    assert rate.rate(last + 0.1) == pytest.approx(10.0)  # 100 ms without a row


def test_the_policy_satisfies_the_protocol() -> None:
    policies: list[Policy] = [AdaptivePolicy(8), FixedWindow(8)]
    for policy in policies:
        policy.observe_arrivals(3, NOW)
        policy.observe_batch(3, 0.001, NOW)
        assert isinstance(policy.estimates(), dict)


# The fixed window: Triton's behaviour, unchanged unless row_cap or preferred sizes are set.

def test_fixed_window_is_unchanged() -> None:
    window = FixedWindow(8, 0.002)
    waiting = window.decide(NOW, 1, NOW, FAR)
    assert not waiting.dispatch and waiting.wait_s == pytest.approx(0.002)
    assert window.decide(NOW + 0.002, 1, NOW, FAR) == Decision(True, reason="window")
    assert window.decide(NOW, 8, NOW, FAR) == Decision(True, reason="full")
    assert window.decide(NOW, 1, NOW, NOW + 0.001) == Decision(True, reason="deadline")
    window.observe_batch(8, 0.01, NOW)
    window.observe_arrivals(5, NOW)
    assert window.estimates() == {}
    assert window == FixedWindow(8, 0.002)


def test_fixed_window_row_cap_and_preferred_sizes() -> None:
    window = FixedWindow(64, 0.005, preferred=(4, 8), row_cap=6)
    assert window.decide(NOW, 6, NOW, FAR) == Decision(True, reason="full", max_rows=6)
    assert window.decide(NOW, 5, NOW, FAR) == Decision(True, reason="full", max_rows=4)
    assert not window.decide(NOW, 3, NOW, FAR).dispatch
    assert window.decide(NOW + 0.005, 3, NOW, FAR) == Decision(True, reason="window", max_rows=6)


def test_decision_keeps_its_old_shape() -> None:
    assert Decision(True, 0.0, "full").max_rows is None


def test_make_policy_follows_the_config() -> None:
    batching = BatchingConfig(max_queue_delay_us=20000, preferred_batch_sizes=(16, 8, 128),
                              latency_target_ms=40.0, adaptive=True)
    config = ModelConfig("m", "onnx", max_batch_size=64, batching=batching)
    adaptive = make_policy(config)
    assert isinstance(adaptive, AdaptivePolicy)
    assert (adaptive.max_rows, adaptive.max_delay_s, adaptive.preferred,
            adaptive.latency_target_s) == (64, 0.02, (8, 16), 0.04)
    fixed = make_policy(ModelConfig("m", "onnx", max_batch_size=32,
                                    batching=BatchingConfig(max_queue_delay_us=100, adaptive=False)))
    assert fixed == FixedWindow(32, 0.0001)
    alone = make_policy(ModelConfig("m", "onnx", max_batch_size=0, batching=batching))
    assert isinstance(alone, AdaptivePolicy)
    assert (alone.max_rows, alone.max_delay_s, alone.preferred) == (1, 0.0, ())
