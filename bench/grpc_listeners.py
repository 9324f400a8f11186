"""The two gRPC listeners side by side: ``CONVEYOR_GRPC_SERVER=native`` against ``grpcio``.

Usage: python -m bench.grpc_listeners [--models mlp_tiny,mlp_medium] [--rounds 2] [--duration 8]

One redis-server and one Celery worker per model; the API process is restarted for each
listener in turn (native, grpcio, native, ...), and each turn is measured with h2load
(one stream per connection, the request ``conveyor bench`` sends) at c=1 and c=64, with
the API process's CPU per call. Alternating turns on one stack keep the machine's drift
out of the comparison. Writes bench/RESULTS-grpc.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from tempfile import TemporaryDirectory

from bench.models import write_repository
from bench.run import binary_input, grpc_call, http_ok, server, started
from conveyor.bench_cli import grpc_target
from conveyor.bench_load import LoadResult, run_h2load
from conveyor.bench_request import grpc_body
from conveyor.harness import ProcessGroup, RedisServer, free_port, group_cpu_s

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("native", "grpcio")
CONCURRENCY = (1, 64)
Row = tuple[str, str, int, LoadResult, float]  # model, listener, c, result, API µs per call


def api_cpu_s(api: ProcessGroup) -> float:
    return sum(group_cpu_s([api]).values())


def turn(model: str, listener: str, env: dict[str, str], work: Path,
         args: argparse.Namespace) -> list[Row]:
    http, grpc_port = free_port(), free_port()
    env = {**env, "CONVEYOR_GRPC_SERVER": listener, "CONVEYOR_HTTP_PORT": str(http),
           "CONVEYOR_GRPC_PORT": str(grpc_port)}
    api = server("api", [sys.executable, "-m", "api.serve"], env, work)
    address = f"127.0.0.1:{grpc_port}"
    rows = []
    with started([api], lambda: http_ok(f"http://127.0.0.1:{http}/v2/models/{model}/ready")):
        tensor = binary_input(model)
        grpc_call(address, model, tensor)
        body = grpc_body(model, [tensor])
        for c in CONCURRENCY:
            run_h2load(grpc_target(address), body, c, args.warmup, work)
            before = api_cpu_s(api)
            result = run_h2load(grpc_target(address), body, c, args.duration, work)
            used = api_cpu_s(api) - before
            rows.append((model, listener, c, result, used / max(result.requests, 1) * 1e6))
            print(f"  {model} {listener:6} c={c:<3} {result.throughput:9,.0f} calls/s  "
                  f"mean {result.mean_ms:6.2f} ms  API {rows[-1][4]:5.0f} µs/call  "
                  f"errors {result.errors}", flush=True)
    return rows


def measure(model: str, work: Path, args: argparse.Namespace) -> list[Row]:
    with ExitStack() as stack:
        redis = stack.enter_context(RedisServer(work))
        assert redis.proc is not None
        env = {**os.environ, "CONVEYOR_REDIS_URL": redis.url,
               "CONVEYOR_MODEL_REPOSITORY": str(work / "repo"), "CONVEYOR_MODELS": model,
               "CONVEYOR_WORKER_PORT": str(free_port()), "CONVEYOR_API_WORKERS": "1",
               "PYTHONUNBUFFERED": "1"}
        worker = server("celery", [sys.executable, "-m", "celery", "-A", "workers.app", "worker",
                                   "-n", f"grpc-bench-{free_port()}@%h", "--loglevel", "WARNING",
                                   "--without-mingle", "--without-gossip"], env, work)
        stack.enter_context(started([worker], lambda: True))
        rows: list[Row] = []
        for _ in range(args.rounds):
            for listener in SERVERS:
                rows += turn(model, listener, env, work, args)
        return rows


def span(values: list[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return format(low, fmt) if low == high else f"{format(low, fmt)}-{format(high, fmt)}"


def report(rows: list[Row], args: argparse.Namespace) -> str:
    lines = ["# The gRPC listeners side by side", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
             f"- command: `python -m bench.grpc_listeners --rounds {args.rounds} "
             f"--duration {args.duration}`",
             "- one stack per model (redis-server, one Celery worker, one API process restarted "
             "per turn with `CONVEYOR_GRPC_SERVER` set), turns alternating native, grpcio; "
             "h2load, one stream per connection, the request of `conveyor bench` (one row, "
             "`raw_input_contents`); figures are the range over the rounds",
             "- API µs/call: utime+stime of the API process during the measured run over the "
             "calls answered", "",
             "| model | c | listener | calls/s | mean ms | API µs/call | errors |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(r[0], r[2], r[1]) for r in rows}, key=lambda k: (k[0], k[1], k[2] != "native"))
    for model, c, listener in keys:
        mine = [r for r in rows if (r[0], r[2], r[1]) == (model, c, listener)]
        lines.append(f"| {model} | {c} | {listener} | {span([r[3].throughput for r in mine], ',.0f')} "
                     f"| {span([r[3].mean_ms for r in mine], '.2f')} | {span([r[4] for r in mine], '.0f')} "
                     f"| {sum(r[3].errors for r in mine)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["mlp_tiny", "mlp_medium"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS-grpc.md")
    args = parser.parse_args()
    rows: list[Row] = []
    with TemporaryDirectory(prefix="conveyor-grpc-bench-") as tmp:
        work = Path(tmp)
        write_repository(work / "repo")
        for model in args.models:
            rows += measure(model, work, args)
    args.out.write_text(report(rows, args))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
