"""The one back-off rule: doubling from a start to a ceiling, reset by a success."""

from __future__ import annotations

from batching.backoff import Backoff, nth_delay


def test_delays_double_up_to_the_ceiling_and_reset_to_the_start() -> None:
    backoff = Backoff(0.5, 3.0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next() == 0.5


def test_the_nth_delay_matches_the_loop_and_never_overflows() -> None:
    backoff = Backoff(1.0, 300.0)
    assert [nth_delay(1.0, 300.0, n) for n in range(10)] == [backoff.next() for _ in range(10)]
    assert nth_delay(1.0, 300.0, 10_000) == 300.0
