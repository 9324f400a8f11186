"""Past capacity with ``batching.overload: lifo`` (the adaptive policy's default where
``latency_target_ms`` is set): a
standing queue is served newest first, and what cannot be answered within the latency
target is answered at once, whatever the request's own timeout; the queue drained, the
order of deadlines comes back."""

from __future__ import annotations

import time

import numpy as np
import pytest

from batching.adaptive import AdaptivePolicy
from batching.config import ModelConfig
from batching.config_schema import ConfigError
from batching.envelope import Request
from batching.former import BatchFormer, Entry
from batching.policy import FixedWindow
from bench.open_loop import poisson
from bench.scheduler_sim import Device, run_loop
from tests.unit.test_shedding import REPLY, make_loop, request, teach

NOW = 1_000_000.0


def entry(n: int, enq_ago_s: float, timeout_s: float = 30.0, prio: int = 1) -> Entry:
    enq = NOW - enq_ago_s
    req = Request(str(n), "r", int((enq + timeout_s) * 1000), enq * 1000, prio, [])
    return Entry("s", str(n), req, NOW)


def order(former: BatchFormer) -> list[str]:
    return [e.entry_id for e in former.take("test", 64).entries]


def former(lifo: bool = True) -> BatchFormer:
    return BatchFormer(FixedWindow(64), 64, target_s=0.05, lifo=lifo)


def test_a_request_is_scheduled_against_the_sooner_of_its_deadline_and_the_target() -> None:
    f = former()
    # 1: enqueued 10 ms ago, 1 s timeout: due in 40 ms (the target). 2: 5 ms ago, 20 ms
    # timeout: due in 15 ms (its own). 3: 30 ms ago: due in 20 ms.
    f.add([entry(1, 0.010, 1.0), entry(2, 0.005, 0.020), entry(3, 0.030, 30.0)])
    assert f.due(f._pending[0]) == NOW - 0.005 + 0.020
    assert order(f) == ["2", "3", "1"]
    plain = BatchFormer(FixedWindow(64), 64)  # no target: its own deadline only
    plain.add([entry(1, 0.010, 1.0), entry(2, 0.005, 0.020), entry(3, 0.030, 30.0)])
    assert order(plain) == ["2", "1", "3"]


def test_past_capacity_lifo_serves_the_newest_first_within_a_level() -> None:
    for lifo, expected in ((True, ["2", "1", "4", "3"]), (False, ["1", "2", "3", "4"])):
        f = former(lifo)
        f.add([entry(1, 0.040, prio=1), entry(2, 0.001, prio=1),
               entry(3, 0.030, prio=2), entry(4, 0.002, prio=2)])
        f.overload(True)
        assert order(f) == expected, lifo
    f = former()
    f.add([entry(1, 0.040), entry(2, 0.001)])
    f.overload(True)
    f.overload(False)  # the queue drained: the order of deadlines again
    assert order(f) == ["1", "2"]


def test_past_capacity_what_cannot_make_the_target_is_refused_at_once() -> None:
    loop, streams, model = make_loop(adaptive=True, target_ms=100.0, overload="lifo")
    teach(loop, 0.010)  # t(n) = 10 ms; the reserve, 30% of the target: a 40 ms horizon
    old = [request(60.0) for _ in range(9)]  # more than the 8 rows the process holds
    for each in old:
        streams.put(each)
    loop.step()
    assert not loop.expiry.overloaded  # a backlog, but not yet as long as the target
    time.sleep(0.12)  # it outlasts the target; the 9th request has waited 120 ms
    soon, fresh = request(0.03), [request(60.0) for _ in range(7)]
    for each in (soon, *fresh):
        streams.put(each)
    loop.step()
    got = {r.id: r for r in streams.replies(REPLY)}
    assert loop.expiry.overloaded and loop.former.overloaded
    assert got[old[-1].id].error_code == "overloaded"  # its own 60 s have not passed
    assert "latency target" in got[old[-1].id].error
    assert got[soon.id].error_code == "deadline_exceeded"  # its own deadline is sooner
    assert model.ran == [8, 6] and all(got[each.id].ok for each in fresh[:6])
    assert streams.stats["shed_count"] == 2
    assert loop.expiry.room(8) == 64  # past capacity every read takes in the newest too
    loop.step()  # the last fresh one, read alone: the queue drained
    assert [(r.id, r.ok) for r in streams.replies(REPLY)] == [(fresh[-1].id, True)]
    assert loop.expiry.overloaded  # drained once: a standing queue may drain now and then
    time.sleep(0.11)  # drained for as long as the target
    loop.step()
    assert not loop.expiry.overloaded and not loop.former.overloaded
    assert loop.expiry.room(8) == 8


def test_fifo_keeps_the_order_of_deadlines_and_refuses_only_by_them() -> None:
    loop, streams, model = make_loop(adaptive=True, target_ms=100.0, overload="fifo")
    teach(loop, 0.010)
    old = [request(60.0) for _ in range(9)]
    for each in old:
        streams.put(each)
    loop.step()
    time.sleep(0.12)
    fresh = [request(60.0) for _ in range(7)]
    for each in fresh:
        streams.put(each)
    loop.step()
    got = {r.id: r for r in streams.replies(REPLY)}
    assert got[old[-1].id].ok and model.ran == [8, 8]  # the oldest first, late but run
    assert loop.expiry.overloaded and loop.expiry.room(8) == 8  # no reads beyond a batch


def test_the_overload_order_is_a_config_key() -> None:
    def overload(batching: dict[str, object]) -> str:
        return ModelConfig.from_dict("m", {"batching": batching}, "python").batching.overload

    assert overload({"latency_target_ms": 50}) == "lifo"
    assert overload({"latency_target_ms": 50, "overload": "fifo"}) == "fifo"
    # No target of its own: served as Triton serves, unless lifo is asked for.
    assert overload({}) == "fifo" and overload({"overload": "lifo"}) == "lifo"
    with pytest.raises(ConfigError, match=r"batching\.overload must be 'lifo' or 'fifo'"):
        overload({"overload": "newest"})


def test_when_not_even_a_lone_row_could_make_the_target_only_deadlines_refuse() -> None:
    """A path estimate longer than the target (a stalled API, say) would otherwise refuse
    every request, and no success would ever bring the estimate down."""
    f = former()
    f.add([entry(1, 0.001, 0.030), entry(2, 0.002, 30.0)])
    f.overload(True)
    late, rows, _ = f.take_unanswerable(NOW, lambda n: 0.060, 64, by_target=True)
    assert [e.entry_id for e in late] == ["1"] and rows == 1  # its own 30 ms: out of reach
    assert len(f) == 1
    late, rows, _ = f.take_unanswerable(NOW, lambda n: 0.010, 64, by_target=True)
    assert late == [] and rows == 1  # 2 makes the target: 10 ms of the 48 ms left


def test_past_capacity_ends_when_everything_waiting_was_refused() -> None:
    loop, streams, _ = make_loop(adaptive=True, target_ms=100.0, overload="lifo")
    teach(loop, 0.010)
    for _ in range(9):
        streams.put(request(60.0))
    loop.step()
    time.sleep(0.12)
    for _ in range(8):
        streams.put(request(60.0))
    loop.step()
    assert loop.expiry.overloaded
    time.sleep(0.12)  # nothing new comes: what is left cannot make the target any more
    loop.step()
    assert len(loop.former) == 0 and loop.expiry.overloaded
    time.sleep(0.11)
    loop.step()
    assert not loop.expiry.overloaded


def test_a_fixed_window_keeps_the_order_of_deadlines_past_capacity() -> None:
    loop, streams, model = make_loop(adaptive=False, target_ms=100.0, overload="lifo")
    old = [request(60.0) for _ in range(9)]
    for each in old:
        streams.put(each)
    loop.step()
    time.sleep(0.12)
    for _ in range(7):
        streams.put(request(60.0))
    loop.step()
    got = {r.id: r for r in streams.replies(REPLY)}
    assert got[old[-1].id].ok and model.ran == [8, 8]  # Triton's rule: the oldest first
    assert loop.former.target_s is None and loop.expiry.room(8) == 8


def test_a_full_queue_whose_requests_still_make_the_target_is_not_past_capacity() -> None:
    loop, _, _ = make_loop(adaptive=True, target_ms=100.0, overload="lifo")
    expiry, now = loop.expiry, time.time()
    fresh = Entry("s", "1", request(60.0), now)
    loop.former.add([fresh])
    expiry.read(8, 8, now - 0.2)  # every read full for 200 ms: a backlog...
    expiry.read(8, 8, now)
    assert not expiry.overloaded  # ...whose oldest has waited less than the target
    old = request(60.0)
    old.enq_ms -= 150.0
    loop.former.add([Entry("s", "2", old, now)])
    expiry.read(8, 8, now)
    assert expiry.overloaded


def test_in_the_simulator_newest_first_keeps_the_capacity_where_fifo_loses_it() -> None:
    """The device model of bench/device_model.py, every request with a 1 s timeout."""
    device = Device("device", 0.008, 0.0005)
    capacity = device.capacity(16)
    for share in (1.1, 1.25):
        arrivals = poisson(share * capacity, 4.0, seed=3)
        kept = {}
        for target in (0.05, None):
            policy = AdaptivePolicy(16, 0.02, latency_target_s=0.05)
            policy.observe_path(0.002)
            out = run_loop(arrivals, device, policy, 16, timeout_s=1.0, target_s=target)
            kept[target] = out.goodput(0.05) * share
            if target is not None:
                assert np.percentile(out.latency[np.isfinite(out.latency)], 50) < 0.035
        assert kept[0.05] >= 0.85 and kept[None] < 0.2, (share, kept)
