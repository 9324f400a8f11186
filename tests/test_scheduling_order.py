"""The order the batch former serves entries in: priority aging, earliest deadline first."""

import json

import numpy as np
import pytest

from batching.config import ConfigError, ModelConfig
from batching.envelope import Request, Tensor
from batching.former import BatchFormer, Entry
from batching.policy import FixedWindow
from batching.triton_config import triton_config
from batching.triton_repository import json_config, pbtxt_config

NOW = 1_000.0


def entry(n: int, prio: int = 2, enq: float = NOW, timeout_s: float = 30.0,
          rows: int = 1) -> Entry:
    x = np.full((rows, 4), n, dtype=np.float32)
    req = Request(str(n), "r", int((enq + timeout_s) * 1000), int(enq * 1000), prio,
                  [Tensor.from_array("x", x)])
    return Entry(f"q:{prio}", f"{n}-0", req, enq)


def former(max_rows: int = 4, max_wait_ms: int | None = None) -> BatchFormer:
    return BatchFormer(FixedWindow(max_rows), max_rows, max_wait_ms=max_wait_ms)


def served(f: BatchFormer, now: float) -> list[str]:
    decision = f.decide(now)
    assert decision.dispatch
    return [e.request.id for e in f.take(decision.reason).entries]


def test_without_aging_priority_is_strict_however_long_an_entry_waited() -> None:
    f = former(max_rows=1)
    f.add([entry(30, prio=3, enq=NOW - 3600), entry(1, prio=1)])
    assert served(f, NOW) == ["1"]


def test_an_entry_that_waited_max_priority_wait_goes_ahead_of_every_level() -> None:
    f = former(max_rows=2, max_wait_ms=500)
    f.add([entry(30, prio=3, enq=NOW), entry(1, prio=1, enq=NOW + 0.1),
           entry(2, prio=1, enq=NOW + 0.1), entry(3, prio=1, enq=NOW + 0.1)])
    assert served(f, NOW + 0.499) == ["1", "2"]
    assert f.best_priority == 1
    assert served(f, NOW + 0.5) == ["30", "3"]


def test_aged_entries_go_oldest_first_whatever_their_level() -> None:
    f = former(max_rows=1, max_wait_ms=100)
    f.add([entry(1, prio=1), entry(30, prio=3, enq=NOW - 0.5), entry(20, prio=2, enq=NOW - 0.3)])
    assert f.best_priority == 1
    assert [served(f, NOW) for _ in range(3)] == [["30"], ["20"], ["1"]]


def test_aging_counts_from_enqueueing_not_from_when_the_process_read_the_entry() -> None:
    f = former(max_rows=1, max_wait_ms=500)
    late = entry(30, prio=3, enq=NOW - 0.6)
    late.seen = NOW  # queued in Redis 0.6 s before this process read it
    f.add([entry(1, prio=1), late])
    assert served(f, NOW) == ["30"]


def test_under_saturating_priority_one_every_priority_three_starts_within_the_bound() -> None:
    """A device that runs a batch every 100 ms, with twice as many priority-1 rows arriving
    as it can run, and a priority-3 request every 350 ms: each priority-3 request starts
    within max_priority_wait plus one batch. Without aging none would ever start."""
    batch_s, wait_ms, max_rows = 0.1, 500, 4
    bound_s = wait_ms / 1000 + batch_s
    for aging in (wait_ms, None):
        f = former(max_rows=max_rows, max_wait_ms=aging)
        started: dict[str, float] = {}
        low_enq: dict[str, float] = {}
        now, n = NOW, 0
        for step in range(100):
            fresh = []
            for _ in range(2 * max_rows):
                n += 1
                fresh.append(entry(n, prio=1, enq=now))
            if step % 4 == 0:
                low = entry(100_000 + step, prio=3, enq=now)
                low_enq[low.request.id] = now
                fresh.append(low)
            f.add(fresh)
            for req_id in served(f, now):
                started.setdefault(req_id, now)
            now += batch_s
        waits = [started[i] - low_enq[i] for i in low_enq if i in started]
        if aging is None:
            assert waits == []
        else:
            last_sent = max(low_enq.values())
            assert len(waits) >= len([t for t in low_enq.values() if t + bound_s < last_sent])
            assert max(waits) <= bound_s + 1e-9, waits


def test_max_priority_wait_is_a_queue_key_and_a_conveyor_parameter_of_config_pbtxt() -> None:
    config = ModelConfig.from_dict("m", {"backend": "python",
                                         "queue": {"max_priority_wait_ms": 750}})
    assert config.queue.max_priority_wait_ms == 750
    assert ModelConfig.from_dict("m", {"backend": "python"}).queue.max_priority_wait_ms is None
    with pytest.raises(ConfigError, match=r"queue.max_priority_wait_ms must be >= 1"):
        ModelConfig.from_dict("m", {"backend": "python", "queue": {"max_priority_wait_ms": 0}})
    pbtxt = pbtxt_config("m", b'parameters { key: "conveyor.max_priority_wait_ms" '
                              b'value { string_value: "750" } }')
    assert ModelConfig.from_dict("m", pbtxt, "python").queue.max_priority_wait_ms == 750
    again = ModelConfig.from_dict("m", json_config("m", json.dumps(triton_config(config))))
    assert again.queue.max_priority_wait_ms == 750


def test_within_a_level_tighter_deadlines_go_in_earlier_batches() -> None:
    f = former(max_rows=2)
    f.add([entry(1, timeout_s=30), entry(2, timeout_s=30, enq=NOW + 0.01),
           entry(3, timeout_s=0.5, enq=NOW + 0.02), entry(4, timeout_s=2, enq=NOW + 0.03)])
    assert served(f, NOW + 0.1) == ["3", "4"]
    assert served(f, NOW + 0.1) == ["1", "2"]


def test_deadlines_never_reorder_levels_and_equal_timeouts_keep_arrival_order() -> None:
    f = former(max_rows=1)
    f.add([entry(5, prio=3, timeout_s=0.2), entry(1, prio=2), entry(2, prio=2, timeout_s=1),
           entry(3, prio=2), entry(4, prio=1, timeout_s=60)])
    assert [served(f, NOW)[0] for _ in range(5)] == ["4", "2", "1", "3", "5"]


def test_a_tight_deadline_read_later_still_joins_the_next_batch_first() -> None:
    f = former(max_rows=2)
    f.add([entry(n) for n in range(1, 4)])
    f.add([entry(9, timeout_s=1, enq=NOW + 0.05)])
    assert served(f, NOW + 0.1) == ["9", "1"]
