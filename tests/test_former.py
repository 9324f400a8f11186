"""The batch former and the fixed-window policy, with an injected clock."""

import numpy as np

from batching.envelope import Request, Tensor
from batching.former import Batch, BatchFormer, Entry, Layout
from batching.policy import FixedWindow

NOW = 1_000.0


def entry(n: int, rows: int = 1, prio: int = 2, width: int = 4, seen: float = NOW,
          deadline: float = NOW + 30) -> Entry:
    x = np.full((rows, width), n, dtype=np.float32)
    req = Request(str(n), "r", int(deadline * 1000), int(seen * 1000), prio,
                  [Tensor.from_array("x", x)])
    return Entry("s", f"{n}-0", req, seen)


def former(max_rows: int = 8, delay_s: float = 0.0) -> BatchFormer:
    return BatchFormer(FixedWindow(max_rows, delay_s), max_rows)


def test_zero_window_dispatches_what_is_waiting_at_once() -> None:
    f = former()
    f.add([entry(1), entry(2)])
    decision = f.decide(NOW)
    assert decision.dispatch and decision.reason == "window"
    assert [e.request.id for e in f.take(decision.reason).entries] == ["1", "2"]


def test_window_waits_until_it_closes_then_dispatches() -> None:
    f = former(delay_s=0.002)
    f.add([entry(1)])
    waiting = f.decide(NOW + 0.0005)
    assert not waiting.dispatch and abs(waiting.wait_s - 0.0015) < 1e-9
    assert f.decide(NOW + 0.002).reason == "window"


def test_full_batch_dispatches_before_the_window() -> None:
    f = former(max_rows=4, delay_s=1.0)
    f.add([entry(1, rows=3), entry(2, rows=1)])
    assert f.decide(NOW).reason == "full"


def test_deadline_inside_the_window_dispatches_early() -> None:
    f = former(delay_s=1.0)
    f.add([entry(1, deadline=NOW + 0.5)])
    assert f.decide(NOW).reason == "deadline"


def test_rows_not_requests_bound_a_batch() -> None:
    f = former(max_rows=4)
    f.add([entry(1, rows=3), entry(2, rows=2), entry(3, rows=1)])
    batch = f.take("full")
    assert [e.request.id for e in batch.entries] == ["1"]
    assert batch.rows == 3
    assert [e.request.id for e in f.take("full").entries] == ["2", "3"]


def test_mixed_row_counts_stack_and_split_back() -> None:
    f = former()
    f.add([entry(1, rows=1), entry(2, rows=3), entry(3, rows=2)])
    batch = f.take("window")
    stacked = batch.stacked_inputs()["x"]
    assert stacked.shape == (6, 4)
    parts = batch.split({"y": stacked * 10})
    assert [p["y"][:, 0].tolist() for p in parts] == [[10], [20, 20, 20], [30, 30]]


def test_shapes_never_stack_oldest_group_first() -> None:
    f = former()
    f.add([entry(1, width=4), entry(2, width=5), entry(3, width=4)])
    first = f.take("window")
    assert [e.request.id for e in first.entries] == ["1", "3"]
    assert [e.request.id for e in f.take("window").entries] == ["2"]


def test_higher_priority_goes_first() -> None:
    f = former()
    f.add([entry(1, prio=3), entry(2, prio=1), entry(3, prio=3)])
    assert [e.request.id for e in f.take("window").entries] == ["2", "1", "3"]


def test_expired_entries_are_taken_out_and_never_batched() -> None:
    f = former()
    f.add([entry(1, deadline=NOW - 0.001), entry(2)])
    assert [e.request.id for e in f.take_expired(NOW)] == ["1"]
    assert [e.request.id for e in f.take("window").entries] == ["2"]
    assert len(f) == 0


def test_empty_former_never_dispatches() -> None:
    assert not former().decide(NOW).dispatch


def test_redelivered_entries_run_alone() -> None:
    f = former()
    again = entry(1)
    again.deliveries = 2
    f.add([again, entry(2), entry(3)])
    assert [e.request.id for e in f.take("window").entries] == ["1"]
    assert [e.request.id for e in f.take("window").entries] == ["2", "3"]


def test_take_honours_a_lower_row_limit() -> None:
    f = former(max_rows=8)
    f.add([entry(n) for n in range(6)])
    assert f.take("policy", max_rows=4).rows == 4


def padded_entry(n: int, length: int) -> Entry:
    x = np.full((1, length), n, dtype=np.int64)
    req = Request(str(n), "r", int((NOW + 30) * 1000), int(NOW * 1000), 2,
                  [Tensor.from_array("tokens", x)])
    return Entry("s", f"{n}-0", req, NOW)


def test_padded_axis_lets_ragged_requests_share_a_batch_and_unpads_outputs() -> None:
    layout = Layout(pad={"tokens": (1, -7)}, unpad={"per_token": 1})
    f = BatchFormer(FixedWindow(8), 8, layout)
    f.add([padded_entry(1, 2), padded_entry(2, 5), padded_entry(3, 3)])
    batch = f.take("window")
    assert len(batch.entries) == 3
    stacked = batch.stacked_inputs()["tokens"]
    assert stacked.shape == (3, 5)
    assert stacked[0].tolist() == [1, 1, -7, -7, -7]
    parts = batch.split({"per_token": stacked * 10, "pooled": stacked.sum(axis=1, keepdims=True)})
    assert [p["per_token"].tolist() for p in parts] == [[[10, 10]], [[20] * 5], [[30] * 3]]
    assert [p["pooled"].shape for p in parts] == [(1, 1)] * 3


def test_unpadded_variable_dims_never_stack() -> None:
    f = BatchFormer(FixedWindow(8), 8)
    f.add([padded_entry(1, 2), padded_entry(2, 5)])
    assert len(f.take("window").entries) == 1


def test_batch_cost_bounds_a_batch() -> None:
    f = BatchFormer(FixedWindow(8), 8, max_cost=10)
    heavy = [entry(n) for n in range(4)]
    for e, cost in zip(heavy, [4, 4, 4, 1], strict=True):
        e.request.params["cost"] = cost
    f.add(heavy)
    assert [e.request.id for e in f.take("window").entries] == ["0", "1"]
    assert [e.request.id for e in f.take("window").entries] == ["2", "3"]


def test_only_a_batch_of_one_lone_request_is_lone() -> None:
    lone, other = entry(1), entry(2)
    lone.request.params["lone"] = 1
    assert Batch([lone], "").lone
    assert not Batch([other], "").lone
    assert not Batch([lone, other], "").lone
