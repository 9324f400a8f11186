"""bench/run.py's points and what it writes: the tables of bench/RESULTS.md and the ratios
against the targets."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from batching.settings import Settings
from bench import triton
from bench.models import MAX_BATCH_SIZE

NCPU = os.cpu_count() or 1
DEFAULT_API = Settings(api_workers=0).api_processes()
"""The API process count ``make run`` starts here (``CONVEYOR_API_WORKERS`` unset)."""


@dataclass
class Point:
    system: str
    concurrency: str
    rps: float
    p50_ms: float
    p99_ms: float | None = None
    errors: int | None = None
    cpu: dict[str, float] = field(default_factory=dict)
    wrk_cpu_s: float | None = None
    other_cpu_s: float = 0.0
    window_s: float = 1.0
    noisy: bool = False


def conveyor_system(api_workers: int) -> str:
    return f"conveyor, {api_workers} API proc{'s' if api_workers > 1 else ''}"


def table_row(p: Point) -> str:
    def f(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"
    split = ", ".join(f"{k} {v:.1f}" for k, v in sorted(p.cpu.items(), key=lambda kv: -kv[1]))
    other = f(p.other_cpu_s, 1) + (" (noisy)" if p.noisy else "")
    server_s = sum(p.cpu.values())
    per_cpu = p.rps * p.window_s / server_s if p.wrk_cpu_s is not None and server_s else None
    return (f"| {p.system} | {p.concurrency} | {f(p.rps, 0)} | {f(p.p50_ms)} | {f(p.p99_ms)} | "
            f"{'-' if p.errors is None else p.errors} | {f(sum(p.cpu.values()) if p.cpu else None, 1)} | "
            f"{split if len(p.cpu) > 1 else ''} | {f(per_cpu, 0)} | {f(p.wrk_cpu_s, 1)} | {other} |")


def ratio_rows(model: str, points: list[Point], top: str) -> list[str]:
    """The targets, for conveyor as ``make run`` serves it (``DEFAULT_API`` API processes)."""
    def pick(system: str, concurrency: str) -> Point | None:
        return next((p for p in points if p.system == system and p.concurrency == concurrency), None)
    conveyor = conveyor_system(DEFAULT_API)
    rows = []
    top_point, plain = pick(conveyor, top), pick("plain FastAPI", top)
    target = {"mlp_medium": 5.0, "mlp_tiny": 2.0}.get(model)
    if top_point and plain and target:
        rows.append(row(f"{model}: conveyor / plain req/s at c={top}", top_point.rps / plain.rps,
                        f"{top_point.rps:,.0f} vs {plain.rps:,.0f}", target, at_least=True))
    for suffix, protocol, goal in (("", "JSON", TRITON_RPS_TARGETS.get(model)),
                                   (", http-binary", "binary tensors", BINARY_TARGETS.get(model)),
                                   (", grpc", "gRPC", BINARY_TARGETS.get(model))):
        mine, theirs = pick(conveyor + suffix, top), pick(triton.PYTHON_BACKEND + suffix, top)
        if mine and theirs and goal:
            rows.append(row(f"{model}: conveyor / Triton req/s at c={top}, {protocol}",
                            mine.rps / theirs.rps, f"{mine.rps:,.0f} vs {theirs.rps:,.0f}", goal,
                            at_least=True))
    one, triton_one = pick(conveyor, "1"), pick(triton.PYTHON_BACKEND, "1")
    if one and triton_one:
        rows.append(row(f"{model}: conveyor / Triton p50 at c=1, JSON", one.p50_ms / triton_one.p50_ms,
                        f"{one.p50_ms:.2f} vs {triton_one.p50_ms:.2f} ms", 1.0, at_least=False))
    grpc, binary = pick(conveyor + ", grpc", top), pick(conveyor + ", http-binary", top)
    if grpc and binary and model in BINARY_TARGETS:
        rows.append(row(f"{model}: conveyor gRPC / HTTP binary req/s at c={top}", grpc.rps / binary.rps,
                        f"{grpc.rps:,.0f} vs {binary.rps:,.0f}", 1.0, at_least=True))
    if model == "mlp_tiny" and one:
        rows.append(f"| mlp_tiny: conveyor p50 at c=1 | {one.p50_ms:.2f} ms | < 1 ms | "
                    f"{'yes' if one.p50_ms < 1.0 else '**no**'} |")
    return rows


def row(what: str, ratio: float, detail: str, target: float, at_least: bool) -> str:
    met = ratio >= target if at_least else ratio <= target
    return (f"| {what} | {ratio:.2f}× ({detail}) | {'≥' if at_least else '≤'}{target:g}× | "
            f"{'yes' if met else '**no**'} |")


TRITON_RPS_TARGETS = {"mlp_tiny": 0.6, "mlp_medium": 0.9}
"""conveyor / Triton (plain Python backend) req/s with JSON at the top concurrency, at least;
at c=1 conveyor's p50 is no worse than Triton's."""
BINARY_TARGETS = {"mlp_medium": 1.0}
"""conveyor / Triton req/s at the top concurrency with binary tensors and with gRPC, at least;
and conveyor's gRPC no slower than its HTTP binary."""


def triton_line(version: str | None, skipped: str | None) -> str:
    if skipped is not None:
        return f"- Triton: not run ({skipped})"
    return (f"- Triton: NVIDIA Triton {version or '?'} from the `{triton.REQUIREMENTS[0]}` wheel (its "
            "tritonserver binary and Python backend) in its own venv, bench/.triton-venv (bench/triton.py); "
            f"the model's ONNX export (bench/models.py) in `{triton.REQUIREMENTS[1]}` with "
            f"{triton.INTRA_OP_THREADS} intra-op threads and spinning off "
            "(`session.intra_op.allow_spinning=0`); dynamic batching, "
            f"`max_queue_delay_microseconds={triton.MAX_QUEUE_DELAY_US}`, max_batch_size "
            f"{MAX_BATCH_SIZE}, one instance; same model names, tensors and wrk request as conveyor. "
            f"{triton.PYTHON_BACKEND}: a plain Python backend `model.py` (bench/triton_model.py) runs "
            "onnxruntime in the backend's stub process (CPU split: tritonserver, stub); the targets "
            f"are against it. {triton.PYTRITON} (with --pytriton): pytriton's `@batch` function "
            "(bench/triton_server.py), one more process hop per batch (CPU split: pytriton, where "
            "onnxruntime runs, and tritonserver with its stub and pytriton's helpers)")


def report(results: dict[str, tuple[list[Point], dict[str, int]]], args: argparse.Namespace,
           started_at: datetime, load: str, triton_version: str | None = None,
           triton_skipped: str | None = None) -> str:
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in
                      Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "unknown")
    lines = [
        "# conveyor benchmark results", "",
        f"- date: {started_at:%Y-%m-%d %H:%M} UTC; load average at the start: {load}",
        f"- machine: {NCPU} CPUs (nproc), {cpu_model}, Linux {os.uname().release}, "
        f"Python {sys.version.split()[0]}",
        f"- command: `{' '.join(['python -m bench.run', *sys.argv[1:]])}`",
        f"- load: `wrk -t1 -c<c> -d{args.duration}s` after a {args.warmup}s warm-up at the same "
        "concurrency, wrk on the same box; one system running at a time",
        "- CPU s: utime+stime of the server's processes during the measured run; req/CPU s: "
        "requests served per server CPU second (less sensitive to other tenants); wrk CPU s: wrk; "
        "other CPU s: the rest of the machine's busy time (other tenants, kernel), a noise "
        f"indicator; (noisy) = above {args.max_other:.0%} of the machine after "
        f"{args.retries} retries",
        "- raw model: the ONNX export in-process, in the onnxruntime session every system runs "
        "(bench/models.py `session`); req/s means rows/s, p50 is one call's time",
        "- plain FastAPI: bench/plain_fastapi.py under one uvicorn process, one onnxruntime call "
        "per request in that session",
        "- wrk sends KServe JSON (one row per request); the http-binary rows send the same row "
        "with the binary tensor extension, binary output asked for (wrk, `conveyor bench`'s "
        "request); the grpc rows send it as `raw_input_contents` over h2c with h2load (one "
        "stream per connection), whose report has no percentiles: their p50 column is the mean, "
        "their p99 the maximum",
        "- GPU (H200) results: [RESULTS-gpu.md](RESULTS-gpu.md); batching policy: "
        "[RESULTS-batching.md](RESULTS-batching.md)",
        "- conveyor: `python -m api.serve` and a Celery worker as `make run` starts them, default "
        "settings (so busy polling for lone requests, `CONVEYOR_BUSY_POLL_US=1000`: "
        "docs/data-path.md section 7, and `CONVEYOR_API_WORKERS` API processes: half the cores "
        "unless the row says otherwise), the models' `model.onnx` with no `config.yaml` "
        "(bench/models.py), own redis-server, gRPC and probe ports; extra environment: "
        + (", ".join(f"`{kv}`" for kv in args.conveyor_env) or "none"),
        triton_line(triton_version, triton_skipped), "",
    ]
    ratios: list[str] = []
    top = str(max(args.concurrency))
    for model, (points, raw_rows) in results.items():
        lines += [f"## {model}", "", "raw rows/s by batch size: "
                  + ", ".join(f"{b}: {r:,}" for b, r in raw_rows.items()), "",
                  "| system | c | req/s | p50 ms | p99 ms | errors | CPU s | CPU split | req/CPU s "
                  "| wrk CPU s | other CPU s |", "|---|---|---|---|---|---|---|---|---|---|---|",
                  *map(table_row, points), ""]
        ratios += ratio_rows(model, points, top)
    lines += ["## Ratios against the targets", "", "| what | measured | target | met |",
              "|---|---|---|---|", *ratios, "",
              f"The targets are conveyor's as `make run` serves it ({conveyor_system(DEFAULT_API)}).", ""]
    return "\n".join(lines)
