"""Upper bound: the benchmark model's ONNX export called in-process, no serving stack.

The same onnxruntime session every benchmarked system runs (bench.models.session).

Usage: python -m bench.raw_model [MODEL ...]   (default: all benchmark models)
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.models import INTRA_OP_THREADS, LAYERS, export_onnx, input_width, session

BATCH_SIZES = (1, 8, 16, 32, 64)
LATENCY_CALLS = 2000
THROUGHPUT_SECONDS = 1.0


def _throughput(sess: Any, batch_size: int, width: int) -> float:
    """Rows/s running ``sess`` on one batch back to back for THROUGHPUT_SECONDS."""
    feed = {"INPUT0": np.random.default_rng(0).standard_normal((batch_size, width), np.float32)}
    calls = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < THROUGHPUT_SECONDS:
        sess.run(None, feed)
        calls += 1
    return calls * batch_size / elapsed


def measure(name: str) -> dict[str, object]:
    """Batch-1 median latency and rows/s per batch size."""
    width = input_width(name)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        export_onnx(name, path)
        sess = session(path)
    feed = {"INPUT0": np.zeros((1, width), np.float32)}
    for _ in range(100):  # warm-up
        sess.run(None, feed)
    latencies: list[float] = []
    for _ in range(LATENCY_CALLS):
        start = time.perf_counter()
        sess.run(None, feed)
        latencies.append(time.perf_counter() - start)
    rows_per_s = {bs: _throughput(sess, bs, width) for bs in BATCH_SIZES}
    best = max(rows_per_s, key=rows_per_s.__getitem__)
    return {
        "model": name,
        "threads": INTRA_OP_THREADS,
        "batch1_p50_ms": statistics.median(latencies) * 1e3,
        "rows_per_s": {str(bs): round(r) for bs, r in rows_per_s.items()},
        "best_batch": best,
        "best_rows_per_s": round(rows_per_s[best]),
    }


if __name__ == "__main__":
    for name in sys.argv[1:] or list(LAYERS):
        print(json.dumps(measure(name)))
