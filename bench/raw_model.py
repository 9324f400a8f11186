"""Upper bound: the benchmark model called in-process, no serving stack.

Usage: python -m bench.raw_model [MODEL ...]   (default: all benchmark models)
"""

import json
import statistics
import sys
import time

import torch

from bench.models import LAYERS, build, input_width

BATCH_SIZES = (1, 8, 16, 32, 64)
LATENCY_CALLS = 2000
THROUGHPUT_SECONDS = 1.0


def _throughput(model: torch.nn.Module, batch_size: int, width: int) -> float:
    """Rows/s running `model` on one batch back to back for THROUGHPUT_SECONDS."""
    x = torch.randn(batch_size, width)
    calls = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < THROUGHPUT_SECONDS:
        model(x)
        calls += 1
    return calls * len(x) / elapsed


def measure(name: str) -> dict[str, object]:
    """Batch-1 median latency and rows/s per batch size, one thread, inference mode."""
    torch.set_num_threads(1)
    model = build(name)
    width = input_width(name)
    with torch.inference_mode():
        x1 = torch.randn(1, width)
        for _ in range(100):  # warm-up
            model(x1)
        latencies: list[float] = []
        for _ in range(LATENCY_CALLS):
            start = time.perf_counter()
            model(x1)
            latencies.append(time.perf_counter() - start)
        rows_per_s = {bs: _throughput(model, bs, width) for bs in BATCH_SIZES}
    best = max(rows_per_s, key=rows_per_s.__getitem__)
    return {
        "model": name,
        "threads": 1,
        "batch1_p50_ms": statistics.median(latencies) * 1e3,
        "rows_per_s": {str(bs): round(r) for bs, r in rows_per_s.items()},
        "best_batch": best,
        "best_rows_per_s": round(rows_per_s[best]),
    }


if __name__ == "__main__":
    for name in sys.argv[1:] or list(LAYERS):
        print(json.dumps(measure(name)))
