"""The API reports to the adaptive policy what its requests spend outside the inference
process (api/outside_path.py), and the policy keeps that, not a fixed share of the latency
target, for the way back when it sheds."""

from __future__ import annotations

import time

import numpy as np
from fastapi.testclient import TestClient

from api.outside_path import OutsidePath
from batching.adaptive import AdaptivePolicy
from batching.envelope import PATH, Reply, Request
from tests.unit.conftest import echo
from tests.unit.memory_dispatch import MemoryDispatcher
from tests.unit.test_shedding import REPLY, make_loop, request


def test_the_reserve_is_the_smoothed_mean_plus_two_mean_deviations_never_below_zero() -> None:
    path = OutsidePath()
    assert path.reserve_us("m") is None
    path.observe("m", 0.012, 0.010)
    assert path.reserve_us("m") == 2000
    for _ in range(400):  # 1 ms and 3 ms in turn: mean 2 ms, mean deviation 1 ms
        path.observe("m", 0.011, 0.010)
        path.observe("m", 0.013, 0.010)
    assert abs(path.reserve_us("m") - 4000) < 150  # type: ignore[operator]
    other = OutsidePath()
    other.observe("m", 0.010, 0.012)  # clocks of two hosts, 2 ms apart
    assert other.reserve_us("m") == 0 and other.reserve_us("n") is None


def test_requests_carry_what_their_model_s_answers_spent_outside_the_inference_process(
        client: TestClient, dispatcher: MemoryDispatcher) -> None:
    def slow_way_back(request: Request) -> Reply:
        reply = echo(request)  # 3 ms in the queue, 0 ms in its batch
        time.sleep(0.02)  # the rest of the request's time here is outside
        return reply

    dispatcher.answer = slow_way_back
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                        "data": np.ones(4).tolist()}]}
    for _ in range(3):
        assert client.post("/v2/models/echo/infer", json=body).status_code == 200
    carried = [r.params.get(PATH) for _, r in dispatcher.submitted]
    assert carried[0] is None  # nothing answered yet: nothing to say
    assert all(isinstance(us, int) and us >= 17_000 for us in carried[1:]), carried


def test_the_policy_keeps_the_reported_path_at_least_its_floor_else_its_default_share() -> None:
    policy = AdaptivePolicy(64, 0.02, latency_target_s=0.05)
    for rows in (1, 8, 32, 64) * 4:
        policy.observe_batch(rows, 0.002 + 0.0005 * rows, 1.0)
    t32 = policy.latency.predict(32)  # 18 ms
    assert abs(policy.shed_horizon_s(32) - (t32 + 0.015)) < 1e-9  # 30% of 50 ms: no report yet
    policy.observe_path(0.001)
    assert abs(policy.shed_horizon_s(32) - (t32 + 0.0025)) < 1e-9  # the floor: 5% of 50 ms
    for _ in range(100):
        policy.observe_path(0.030)
    assert abs(policy.shed_horizon_s(32) - (t32 + 0.030)) < 1e-4
    assert abs(policy.estimates()["shed_reserve_s"] - 0.030) < 1e-4


def test_the_inference_loop_hands_the_path_its_requests_carry_to_the_policy() -> None:
    loop, streams, _ = make_loop(adaptive=True)
    assert isinstance(loop.policy, AdaptivePolicy) and loop.policy.path_s is None
    streams.put(request(60.0))  # from an API that has nothing to report yet
    loop.step()
    assert loop.policy.path_s is None
    reported = request(60.0)
    reported.params[PATH] = 7000
    streams.put(reported)
    loop.step()
    assert loop.policy.path_s == 0.007
    assert [r.ok for r in streams.replies(REPLY)] == [True, True]


def test_a_path_that_is_not_a_count_of_microseconds_is_ignored() -> None:
    loop, streams, _ = make_loop(adaptive=True)
    for bad in ("7000", -1, True, 7.5):
        odd = request(60.0)
        odd.params[PATH] = bad
        streams.put(odd)
    loop.step()
    assert isinstance(loop.policy, AdaptivePolicy) and loop.policy.path_s is None
    assert all(r.ok for r in streams.replies(REPLY))
