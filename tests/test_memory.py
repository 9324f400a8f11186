from batching.memory import PROBE_AFTER, RowCap


def test_oom_halves_the_cap_and_full_batches_probe_back_up() -> None:
    cap = RowCap(limit=64)
    assert cap.cap == 64
    cap.on_oom(40)
    assert cap.cap == 20
    for _ in range(PROBE_AFTER):
        cap.on_success(20)
    assert cap.cap == 21
    cap.on_success(5)  # a small batch says nothing about the device's limit
    for _ in range(PROBE_AFTER - 1):
        cap.on_success(21)
    assert cap.cap == 21


def test_cap_never_below_one_nor_above_the_limit() -> None:
    cap = RowCap(limit=2)
    cap.on_oom(1)
    assert cap.cap == 1
    for _ in range(10 * PROBE_AFTER):
        cap.on_success(cap.cap)
    assert cap.cap == 2
