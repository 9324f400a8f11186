"""Past capacity, which waiting rows a batch can still answer in time.

A batch of ``n`` rows started now is answered ``horizon(n)`` from now (the policy's fitted
whole-path time plus its reserve for the way back). It can answer ``n`` rows in time when
``n`` waiting rows have a deadline at least that far away; the largest such ``n`` serves
the most rows per second that still make it (a batch's time grows slower than its rows).
Rows whose deadline falls sooner cannot be answered in time by that batch, nor by any
later one: the inference loop answers them at once with a deadline error, and caps the
next batch at ``n`` so that every row it runs makes it.

Feasibility is downward closed (a smaller batch is quicker and more rows have time for
it), so ``n`` is found by bisection over the deadlines sorted latest first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def rows_in_time(deadlines: Iterable[tuple[float, int]], now: float,
                 horizon: Callable[[int], float], cap: int) -> tuple[int, float]:
    """``deadlines``: (deadline, rows) of each waiting entry. Returns the largest batch ``n``
    (at most ``cap`` rows) whose rows can all be answered in time, 0 when not even one row
    can, and the deadline below which a waiting row cannot be answered in time: that of
    batch ``n``, or of a lone row when no batch fits."""
    latest_first = sorted(deadlines, key=lambda d: -d[0])
    per_row: list[float] = []
    for deadline, rows in latest_first:
        per_row.extend([deadline] * rows)
        if len(per_row) >= cap:
            break
    low, high = 0, min(cap, len(per_row))
    while low < high:  # per_row[n - 1]: the n-th latest deadline
        mid = (low + high + 1) // 2
        if per_row[mid - 1] - now >= horizon(mid):
            low = mid
        else:
            high = mid - 1
    return low, now + horizon(max(low, 1))
