from batching.memory import PROBE_AFTER, RELAX_AFTER, RowCap


def full_batches(cap: RowCap, count: int) -> None:
    for _ in range(count):
        cap.on_success(cap.cap)


def test_oom_halves_the_cap_and_full_batches_probe_back_up() -> None:
    cap = RowCap(limit=64)
    assert cap.cap == 64
    cap.on_oom(40)
    assert cap.cap == 20
    full_batches(cap, PROBE_AFTER)
    assert cap.cap == 21
    cap.on_success(5)  # a small batch says nothing about the device's limit
    for _ in range(PROBE_AFTER - 1):
        cap.on_success(21)
    assert cap.cap == 21


def test_probing_stops_below_the_size_that_ran_out_then_relaxes_slowly() -> None:
    cap = RowCap(limit=16)
    cap.on_oom(6)
    full_batches(cap, PROBE_AFTER * 10)
    assert cap.cap == 5
    full_batches(cap, RELAX_AFTER)
    assert cap.cap == 6


def test_cap_never_below_one_nor_above_the_limit() -> None:
    cap = RowCap(limit=2)
    cap.on_oom(1)
    assert cap.cap == 1
    full_batches(cap, 10 * RELAX_AFTER)
    assert cap.cap == 2


def test_bisecting_one_oversized_batch_lowers_the_cap_once_per_size() -> None:
    cap = RowCap(limit=64)
    for rows in (64, 32, 32, 16, 16, 16, 16):  # halves of halves, all too big
        cap.on_oom(rows)
    assert cap.cap == 8 and cap.ceiling == 15
