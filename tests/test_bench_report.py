"""bench/run_report.py: the target rows of bench/RESULTS.md compare like with like."""

from __future__ import annotations

from bench import triton
from bench.run_report import DEFAULT_API, Point, conveyor_system, ratio_rows

CONVEYOR = conveyor_system(DEFAULT_API)


def point(system: str, concurrency: str, rps: float, p50_ms: float = 1.0) -> Point:
    return Point(system, concurrency, rps, p50_ms)


def test_each_protocol_is_compared_with_the_same_protocol() -> None:
    points = [
        point("plain FastAPI", "64", 500),
        point(triton.PYTHON_BACKEND, "64", 5000), point(triton.PYTHON_BACKEND, "1", 600, 1.5),
        point(triton.PYTHON_BACKEND + ", http-binary", "64", 8000),
        point(triton.PYTHON_BACKEND + ", grpc", "64", 4000),
        point(CONVEYOR, "64", 4600), point(CONVEYOR, "1", 700, 1.2),
        point(CONVEYOR + ", http-binary", "64", 6000), point(CONVEYOR + ", grpc", "64", 4400),
        point(conveyor_system(DEFAULT_API + 1), "64", 99_999),  # not the default: no target
    ]
    rows = ratio_rows("mlp_medium", points, "64")
    assert rows == [
        "| mlp_medium: conveyor / plain req/s at c=64 | 9.20× (4,600 vs 500) | ≥5× | yes |",
        "| mlp_medium: conveyor / Triton req/s at c=64, JSON | 0.92× (4,600 vs 5,000) | ≥0.9× | yes |",
        "| mlp_medium: conveyor / Triton req/s at c=64, binary tensors | 0.75× (6,000 vs 8,000) "
        "| ≥1× | **no** |",
        "| mlp_medium: conveyor / Triton req/s at c=64, gRPC | 1.10× (4,400 vs 4,000) | ≥1× | yes |",
        "| mlp_medium: conveyor / Triton p50 at c=1, JSON | 0.80× (1.20 vs 1.50 ms) | ≤1× | yes |",
        "| mlp_medium: conveyor gRPC / HTTP binary req/s at c=64 | 0.73× (4,400 vs 6,000) | ≥1× "
        "| **no** |",
    ]


def test_missing_systems_leave_their_rows_out() -> None:
    rows = ratio_rows("mlp_tiny", [point(CONVEYOR, "1", 2000, 0.4)], "64")
    assert rows == ["| mlp_tiny: conveyor p50 at c=1 | 0.40 ms | < 1 ms | yes |"]
