"""A batch's statistics hold no counter that adds nothing: each field is a HINCRBY of
Redis's (issue 37)."""

from __future__ import annotations

from batching.envelope import Reply, Request
from batching.former import Entry
from workers.batch_stats import batch_counters


def entry(n: int) -> Entry:
    return Entry("s", f"1-{n}", Request(str(n), "r", 0, 0, 1, []), 0.0)


def test_a_batch_that_all_succeeded_adds_no_failure_counters() -> None:
    answered = [(entry(n), Reply(str(n))) for n in range(3)]
    counters = batch_counters(answered, 3, 1.0, 1.5, [10, 20, 30])
    assert counters["success_count"] == 3 and counters["inference_count"] == 3
    assert "fail_count" not in counters and "fail_ns" not in counters
    assert all(counters.values())


def test_a_failed_request_is_counted() -> None:
    answered = [(entry(0), Reply("0")), (entry(1), Reply("1", error_code="model_failure", error="boom"))]
    counters = batch_counters(answered, 2, 1.0, 1.5, [10, 20, 30])
    assert counters["fail_count"] == 1 and counters["success_count"] == 1
