"""Histograms the workers keep in a model's stats hash, and how they are read back.

Batches execute in the workers and the API serves ``/metrics``, so per-batch histograms
travel through the stats hash (:meth:`batching.keys.Keys.stats`) as one counter per bucket,
added to in the same write as the batch's other totals. The API turns them back into
Prometheus histograms at scrape time (api/metrics_shared.py).

* Batch sizes need no fields of their own: ``batch:{rows}:count`` (Triton's per-size
  batch statistics) already counts executed batches by their exact size.
* Execution time: ``exec_le:{bound}`` counts batches whose time was at most ``bound``
  seconds and above the next lower bound (``exec_le:+Inf`` past the last one); the sum
  is that of ``batch:{rows}:ns``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                   5.0, 10.0, 30.0)
"""Upper bounds (seconds) of request latency and batch execution histograms."""
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Upper bounds (rows) of batch size histograms."""
EXECUTION_FIELD = "exec_le:"
INF = "+Inf"


def execution_field(seconds: float) -> str:
    """The stats hash field that counts a batch which took ``seconds``."""
    index = bisect.bisect_left(LATENCY_BUCKETS, seconds)
    return EXECUTION_FIELD + (str(LATENCY_BUCKETS[index]) if index < len(LATENCY_BUCKETS)
                              else INF)


def cumulative(counts: Mapping[float, int], bounds: Iterable[float]) -> list[tuple[str, int]]:
    """Prometheus buckets (``le`` label, cumulative count, ending with ``+Inf``) of
    ``counts``: observations by value (or by the bucket bound they were counted under,
    ``inf`` past the last bound)."""
    buckets = []
    running = 0
    values = sorted(counts.items())
    i = 0
    for bound in bounds:
        while i < len(values) and values[i][0] <= bound:
            running += values[i][1]
            i += 1
        buckets.append((str(float(bound)), running))
    buckets.append((INF, running + sum(n for _, n in values[i:])))
    return buckets


def batch_sizes(counters: Mapping[str, int]) -> dict[float, int]:
    """Executed batches by rows, from ``batch:{rows}:count``."""
    sizes: dict[float, int] = {}
    for key, count in counters.items():
        kind, _, rest = key.partition(":")
        rows, _, what = rest.partition(":")
        if kind == "batch" and what == "count" and rows.isdigit():
            sizes[float(rows)] = count
    return sizes


def execution_times(counters: Mapping[str, int]) -> dict[float, int]:
    """Executed batches by the bound of their execution time bucket (``inf``: past the last)."""
    return {float(key.removeprefix(EXECUTION_FIELD).replace(INF, "inf")): count
            for key, count in counters.items() if key.startswith(EXECUTION_FIELD)}
