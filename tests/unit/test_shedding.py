"""Requests that cannot be answered before their deadline are answered at once, not run late
(the adaptive policy), and the policy learns the whole path of a batch, not the model alone."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from typing import Any

import numpy as np
import numpy.typing as npt

from batching.adaptive import AdaptivePolicy
from batching.config import BatchingConfig, ModelConfig, TensorSpec
from batching.envelope import Request, Tensor
from batching.keys import Keys
from batching.policy import FixedWindow
from batching.shedding import rows_in_time
from bench.open_loop import poisson
from bench.scheduler_sim import Device, run_loop
from workers.inference import InferenceLoop
from workers.memory_streams import MemoryReclaimer, MemoryStreams
from workers.shared_state import SharedState

KEYS = Keys("t")
REPLY = "reply:test"


class Echo:
    def __init__(self) -> None:
        self.ran: list[int] = []

    def predict(self, inputs: dict[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        self.ran.append(int(inputs["x"].shape[0]))
        return {"y": inputs["x"]}


def make_loop(adaptive: bool, target_ms: float = 50.0,
              overload: str = "fifo") -> tuple[InferenceLoop, MemoryStreams, Echo]:
    """With ``overload: fifo`` past capacity sheds by each request's own deadline only
    (tests/unit/test_overload_lifo.py has ``lifo``)."""
    config = ModelConfig(
        "m", "python", 8, inputs=(TensorSpec("x", "FP32", (-1, 2)),),
        outputs=(TensorSpec("y", "FP32", (-1, 2)),),
        batching=BatchingConfig(max_queue_delay_us=0, adaptive=adaptive,
                                latency_target_ms=target_ms, overload=overload))
    streams = MemoryStreams(KEYS.queues("m", config.queue.priority_levels))
    model = Echo()
    loop = InferenceLoop(config, model, streams, MemoryReclaimer(streams),
                         SharedState(multiprocessing.get_context("spawn")), KEYS)
    return loop, streams, model


def request(deadline_in_s: float) -> Request:
    now = time.time()
    x = Tensor.from_array("x", np.ones((1, 2), np.float32))
    return Request(uuid.uuid4().hex, REPLY, int((now + deadline_in_s) * 1000), int(now * 1000), 1, [x])


def teach(loop: InferenceLoop, seconds: float, batches: int = 12) -> None:
    for _ in range(batches):
        loop.policy.observe_batch(1, seconds, time.time())


def test_past_capacity_the_adaptive_policy_answers_at_once_what_a_batch_cannot_finish_in_time() -> None:
    loop, streams, model = make_loop(adaptive=True, target_ms=20.0)
    teach(loop, 0.5)
    for _ in range(9):  # more than the 8 rows the process holds: a backlog begins
        streams.put(request(60.0))
    loop.step()
    time.sleep(0.03)  # and outlasts the 20 ms latency target
    hopeless, fine = request(0.2), [request(60.0) for _ in range(8)]
    for each in (hopeless, *fine):
        streams.put(each)
    loop.step()
    got = {r.id: r for r in streams.replies(REPLY)}
    assert got[hopeless.id].error_code == "deadline_exceeded"
    assert "before its deadline" in got[hopeless.id].error
    assert all(got[each.id].ok for each in fine[:6])
    assert model.ran == [8, 7]
    assert streams.stats["shed_count"] == 1


def test_a_burst_shorter_than_the_latency_target_sheds_nothing() -> None:
    loop, streams, model = make_loop(adaptive=True)
    teach(loop, 0.5)
    soon, fine = request(0.2), [request(60.0) for _ in range(8)]  # a forecast says "late"
    for each in (soon, *fine):  # a backlog, but one that has only begun
        streams.put(each)
    loop.step()
    got = {r.id: r for r in streams.replies(REPLY)}
    assert got[soon.id].ok and model.ran == [8]
    assert streams.stats["shed_count"] == 0


def test_below_capacity_nothing_is_shed_on_a_forecast() -> None:
    loop, streams, model = make_loop(adaptive=True)
    teach(loop, 0.5)
    soon, fine = request(0.2), request(60.0)
    streams.put(soon)
    streams.put(fine)
    loop.step()
    assert [r.ok for r in streams.replies(REPLY)] == [True, True]
    assert model.ran == [2] and streams.stats["shed_count"] == 0


def test_nothing_is_shed_before_the_fit_is_trusted_nor_under_a_fixed_window() -> None:
    for adaptive, taught in ((True, 3), (False, 12)):
        loop, streams, model = make_loop(adaptive=adaptive)
        teach(loop, 0.5, taught)
        for _ in range(9):
            streams.put(request(0.2))
        loop.step()
        assert [r.ok for r in streams.replies(REPLY)] == [True] * 8
        assert model.ran == [8] and streams.stats["shed_count"] == 0


def test_the_horizon_is_the_fitted_time_of_the_batch_that_would_start_plus_the_reserve() -> None:
    policy = AdaptivePolicy(64, 0.02, latency_target_s=0.05)
    assert policy.shed_horizon_s(10) == 0.0
    for rows in (1, 8, 32, 64) * 4:
        policy.observe_batch(rows, 0.002 + 0.0005 * rows, 1.0)
    # t(32) = 18 ms, and 30% of the 50 ms target kept for the API and the reply path.
    assert abs(policy.shed_horizon_s(32) - 0.033) < 0.001
    policy.shed_reserve = 0.0
    assert abs(policy.shed_horizon_s(32) - 0.018) < 0.001
    assert abs(policy.shed_horizon_s(500) - policy.shed_horizon_s(64)) < 1e-9
    assert FixedWindow(64, 0.005).shed_horizon_s(64) == 0.0


def test_the_policy_learns_the_reading_time_of_a_batch_not_only_the_model() -> None:
    loop, streams, _ = make_loop(adaptive=True)
    for _ in range(12):
        streams.put(request(60.0))
        loop.step()
    quick = loop.policy.estimates()["latency_a_s"]
    slow, streams_slow, _ = make_loop(adaptive=True)
    for _ in range(12):
        streams_slow.put(request(60.0))
        # CPU spent on the loop's thread before the batch (decoding, say) is part of its cost.
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        slow.step()
    # 50 ms of CPU is at least 50 ms of wall time; a busy host may stretch the quick
    # loop's steps by a few milliseconds to tens, but not by 30 more than the slow one's.
    assert slow.policy.estimates()["latency_a_s"] > quick + 0.02


def test_past_capacity_shedding_keeps_goodput_where_a_fixed_window_loses_it() -> None:
    device = Device("linear", 0.002, 0.0003)
    capacity = device.capacity(64)
    arrivals = poisson(1.25 * capacity, 3.0, seed=4)
    target = 0.05
    fixed = run_loop(arrivals, device, FixedWindow(64, 0.0), 64, timeout_s=target)
    adaptive = run_loop(arrivals, device, AdaptivePolicy(64, 0.02, latency_target_s=target), 64,
                        timeout_s=target)
    assert adaptive.goodput(target) > fixed.goodput(target) + 0.05


def test_the_largest_batch_whose_rows_all_make_it_is_chosen_and_only_the_rest_shed() -> None:
    def horizon(rows: int) -> float:
        return 0.010 + 0.001 * rows  # a batch of n rows is answered 10 ms + 1 ms per row from now

    # 40 rows, one per entry, with 1 ms to 40 ms left: a batch of 40 would take 50 ms.
    deadlines = [(100.0 + k / 1000, 1) for k in range(1, 41)]
    rows, threshold = rows_in_time(deadlines, 100.0, horizon, 64)
    # n rows fit while the n-th latest deadline (41 - n ms away) is at least 10 + n ms away.
    assert rows == 15 and abs(threshold - 100.025) < 1e-9
    assert rows_in_time(deadlines, 100.0, horizon, 8) == (8, 100.0 + horizon(8))
    # An entry's rows count as many: one entry of 30 rows with 45 ms left fits as a whole.
    assert rows_in_time([(100.045, 30)], 100.0, horizon, 64)[0] == 30
    # Nothing fits, not even one row: only what a lone row would miss goes.
    rows, threshold = rows_in_time([(100.005, 1), (100.008, 1)], 100.0, horizon, 64)
    assert rows == 0 and abs(threshold - 100.011) < 1e-9


def test_where_a_full_batch_would_miss_every_deadline_a_smaller_one_still_runs() -> None:
    """On a slow host a full batch takes about the whole latency target: shedding what it
    cannot answer in time would shed everything (it once did, and lost half the goodput
    near capacity). The loop runs the largest batch whose rows make it instead."""
    loop, streams, model = make_loop(adaptive=True, target_ms=100.0)
    policy = loop.policy
    assert isinstance(policy, AdaptivePolicy)
    policy.shed_reserve = 0.0
    policy.latency.forget = 1.0  # so that the one quick batch run below barely moves it
    for rows in (1, 4, 8) * 100:  # t(n) = 20 ms + 10 ms per row: t(8) = 100 ms
        policy.observe_batch(rows, 0.020 + 0.010 * rows, time.time())
    for _ in range(9):  # more than the 8 rows the process holds: a backlog begins
        streams.put(request(60.0))
    loop.step()
    time.sleep(0.11)  # and outlasts the latency target
    left_ms = (120, 110, 100, 90, 60, 55, 50)  # 20 ms to spare either way for a slow step
    ahead = [request(ms / 1000) for ms in left_ms]
    for each in ahead:  # beside the one 60 s request the first step left waiting
        streams.put(each)
    loop.step()
    got = {r.id: r for r in streams.replies(REPLY)}
    # The n-th latest deadline must be 20 + 10·n ms away: n = 5 (60 s, 120, 110, 100, 90 ms
    # against 70 ms; the 6th, 60 ms, against 80), and what is due within t(5) = 70 ms is
    # shed. A full batch of 8 would take 100 ms: judged by it, five would go.
    assert model.ran == [8, 5]
    assert [got[each.id].ok for each in ahead] == [True] * 4 + [False] * 3
    assert streams.stats["shed_count"] == 3
