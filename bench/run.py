"""One benchmark run, side by side (bench/RESULTS.md): raw model, plain FastAPI wrapper, Triton, conveyor.

Usage: python -m bench.run [--duration S] [--models mlp_tiny,mlp_medium] [--concurrency 1,8,64]
                           [--api-workers 1,2] [--binary-concurrency 1,64] [--pytriton]
                           [--no-triton] [--out bench/RESULTS.md]

Per model, all on the same ONNX export: the raw in-process model (bench.raw_model), the
plain wrapper under one uvicorn process, NVIDIA Triton in a plain Python backend (and with
--pytriton through pytriton; bench/triton.py, in its own venv, created on first use; skipped
with --no-triton or when the venv cannot be made), then conveyor (redis-server, ``python -m
api.serve``, a Celery worker) once per API process count: each under wrk with JSON at every
concurrency, Triton and conveyor's default also with binary tensors (wrk) and gRPC (h2load);
only one system runs at a time. CPU seconds come from /proc:
each server's process group, wrk, and the rest of the machine ("other": other tenants). A
point whose "other" CPU exceeds --max-other of the machine is measured again (--retries) and
the least disturbed attempt is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TypedDict

import numpy as np

from bench import triton
from bench.models import LAYERS, MAX_BATCH_SIZE, write_repository
from bench.run_report import DEFAULT_API, NCPU, Point, conveyor_system, report
from bench.wrk import WrkResult, run_wrk
from conveyor.bench_cli import grpc_target
from conveyor.bench_load import run_h2load
from conveyor.bench_load import run_wrk as run_wrk_body
from conveyor.bench_request import Body, Input, binary_body, grpc_body
from conveyor.harness import ProcessGroup, RedisServer, free_port, group_cpu_s, wait_until

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


def http_ok(url: str, body: bytes | None = None) -> bool:
    headers = {"content-type": "application/json"} if body is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=5) as r:
            return bool(r.status == 200)
    except OSError:  # URLError and HTTPError are OSErrors
        return False


STOP_TIMEOUT_S = 20.0
CHILD_LABELS = {"celery": "inference", "tritonserver": "stub", "pytriton": "tritonserver"}
"""CPU of a group's processes other than its leader counts under this label: a Celery
worker's children are its inference processes; tritonserver's, the Python backend's stub
(which runs onnxruntime); pytriton's (the leader runs onnxruntime), tritonserver, its stub and
pytriton's helpers."""


def server(name: str, argv: list[str], env: dict[str, str], logdir: Path) -> ProcessGroup:
    """A server in its own session, so its whole process tree shares one pgid."""
    return ProcessGroup(name, argv, env, logdir / f"{name}-{time.monotonic_ns()}.log", cwd=ROOT)


@contextmanager
def started(groups: list[ProcessGroup], ready: Callable[[], bool],
            timeout: float = 120) -> Iterator[None]:
    """Wait until ``ready`` holds (failing fast if a server dies); stop every group on exit."""
    try:
        wait_until(ready, timeout, f"{[g.name for g in groups]} to start", interval=0.2,
                   watch=groups)
        yield
    finally:
        for group in reversed(groups):
            group.stop(STOP_TIMEOUT_S)


def machine_busy_s() -> float:
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / TICKS  # minus idle and iowait


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_quiet(timeout: float, max_busy: float = 0.3) -> None:
    """Wait (up to ``timeout``) until the machine stays nearly idle for one second."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy0 = machine_busy_s()
        time.sleep(1.0)
        if machine_busy_s() - busy0 < max_busy:
            return


def least_noisy(attempt: Callable[[], Point], args: argparse.Namespace) -> Point:
    """Run ``attempt`` until other tenants stay under --max-other (or out of retries); keep the best."""
    best: Point | None = None
    for retry in range(args.retries, -1, -1):
        wait_quiet(args.quiet_timeout)
        point = attempt()
        best = point if best is None or point.other_cpu_s < best.other_cpu_s else best
        point.noisy = point.other_cpu_s > args.max_other * NCPU * point.window_s
        if not point.noisy or not retry:
            break
        print(f"  {point.system} c={point.concurrency}: other tenants used "
              f"{point.other_cpu_s:.1f} CPU s, measuring again", file=sys.stderr, flush=True)
    assert best is not None
    print(f"  {best.system:<22} c={best.concurrency:<3} {best.rps:8.0f} req/s  p50 "
          f"{best.p50_ms:7.2f} ms  p99 {best.p99_ms or 0:7.2f} ms  errors {best.errors or 0}  "
          f"cpu {sum(best.cpu.values()):.1f}s  other {best.other_cpu_s:.1f}s", file=sys.stderr)
    return best


Load = Callable[[int, int], WrkResult]
"""(connections, seconds) -> a result with rps, p50_ms, p99_ms and errors."""


def wrk_point(system: str, url: str, body: str, groups: list[ProcessGroup], args: argparse.Namespace,
              concurrency: int) -> Point:
    return load_point(system, lambda c, s: run_wrk(url, body, connections=c, duration_s=s),
                      groups, args, concurrency)


def c_load(protocol: str, target: str, request: Body, work: Path) -> Load:
    """Load from a C generator: wrk for HTTP (``protocol`` "binary": the binary tensor
    extension), h2load for gRPC (``target`` HOST:PORT), one request in flight per connection."""
    def load(connections: int, seconds: int) -> WrkResult:
        if protocol == "grpc":
            res = run_h2load(grpc_target(target), request, connections, seconds, work)
        else:
            res = run_wrk_body(target, request, connections, seconds, work)
        return {"rps": res.throughput, "p50_ms": res.p50_ms if res.p50_ms is not None else res.mean_ms,
                "p99_ms": res.p99_ms if res.p99_ms is not None else res.max_ms, "errors": res.errors,
                "requests": res.requests}
    return load


def binary_points(system: str, model: str, http_url: str, grpc_address: str, groups: list[ProcessGroup],
                  args: argparse.Namespace, work: Path, concurrency: list[int]) -> list[Point]:
    """``system`` under the binary tensor extension (wrk) and gRPC (h2load) at ``concurrency``;
    one gRPC call through tritonclient first, since h2load cannot read a gRPC error."""
    tensor = binary_input(model)
    grpc_call(grpc_address, model, tensor)
    points = []
    for protocol, target, request in (("http-binary", http_url, binary_body([tensor])),
                                      ("grpc", grpc_address, grpc_body(model, [tensor]))):
        points += [load_point(f"{system}, {protocol}", c_load(protocol, target, request, work),
                              groups, args, c) for c in concurrency]
    return points


def binary_input(model: str) -> Input:
    """The JSON request's row (request_body) as a tensor."""
    data = json.loads(request_body(model))["inputs"][0]["data"]
    return Input("INPUT0", "FP32", np.asarray([data], np.float32))


def grpc_call(address: str, model: str, tensor: Input) -> None:
    """One inference over gRPC that must succeed (AssertionError otherwise)."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(address) as client:
        item = grpcclient.InferInput(tensor.name, list(tensor.array.shape), tensor.datatype)
        item.set_data_from_numpy(tensor.array)
        out = client.infer(model, [item]).as_numpy("OUTPUT0")
    assert out is not None and out.shape == (1, LAYERS[model][-1]), out


def load_point(system: str, load: Load, groups: list[ProcessGroup], args: argparse.Namespace,
               concurrency: int) -> Point:
    """One measured point; the load generator's CPU counts under "wrk CPU s"."""
    def attempt() -> Point:
        load(concurrency, args.warmup)
        cpu0, busy0, kids0 = group_cpu_s(groups, CHILD_LABELS), machine_busy_s(), children_cpu_s()
        res = load(concurrency, args.duration)
        cpu1, busy1, kids1 = group_cpu_s(groups, CHILD_LABELS), machine_busy_s(), children_cpu_s()
        cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
        wrk_s = kids1 - kids0
        return Point(system, str(concurrency), res["rps"], res["p50_ms"], res["p99_ms"],
                     res["errors"], cpu, wrk_s, busy1 - busy0 - sum(cpu.values()) - wrk_s,
                     args.duration)
    return least_noisy(attempt, args)


class RawResult(TypedDict):
    batch1_p50_ms: float
    rows_per_s: dict[str, int]
    best_batch: int
    best_rows_per_s: int


def raw_points(model: str, args: argparse.Namespace) -> tuple[list[Point], dict[str, int]]:
    """bench.raw_model in a subprocess, whose CPU counts as the "server" CPU."""
    runs: list[tuple[Point, RawResult]] = []

    def attempt() -> Point:
        busy0, kids0, t0 = machine_busy_s(), children_cpu_s(), time.monotonic()
        out = subprocess.run([sys.executable, "-m", "bench.raw_model", model], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        cpu, busy = children_cpu_s() - kids0, machine_busy_s() - busy0
        raw: RawResult = json.loads(out.strip().splitlines()[-1])
        point = Point("raw model, batch 1", "-", raw["rows_per_s"]["1"], raw["batch1_p50_ms"],
                      cpu={"raw": cpu}, other_cpu_s=busy - cpu, window_s=time.monotonic() - t0)
        runs.append((point, raw))
        return point
    one = least_noisy(attempt, args)
    raw = next(r for p, r in runs if p is one)
    best, rows = raw["best_batch"], raw["best_rows_per_s"]
    many = Point(f"raw model, batch {best}", "-", rows, 1e3 * best / rows,
                 other_cpu_s=one.other_cpu_s, noisy=one.noisy)
    return [one, many], raw["rows_per_s"]


def uvicorn_argv(app: str, port: int, workers: int = 1, factory: bool = False) -> list[str]:
    """uvicorn serving ``app`` (with ``factory``: a function that builds the app)."""
    return [sys.executable, "-m", "uvicorn", *(["--factory"] if factory else []), app,
            "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--log-level", "warning",
            "--workers", str(workers)]


CONVEYOR_APP = "api.main:create_app"
"""The API's app factory, for ``uvicorn_argv(CONVEYOR_APP, ..., factory=True)``."""


def bench_plain(model: str, body: str, args: argparse.Namespace, work: Path) -> list[Point]:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v2/models/{model}/infer"
    env = {**os.environ, "BENCH_MODEL": model, "PYTHONUNBUFFERED": "1"}
    groups = [server("plain", uvicorn_argv("bench.plain_fastapi:app", port), env, work)]
    with started(groups, lambda: http_ok(url, body.encode())):
        return [wrk_point("plain FastAPI", url, body, groups, args, c) for c in args.concurrency]


def bench_triton(model: str, body: str, args: argparse.Namespace, work: Path,
                 venv: triton.TritonVenv) -> tuple[list[Point], str]:
    """Triton serving ``model`` in the plain Python backend (JSON, binary tensors, gRPC), then
    with --pytriton through pytriton (JSON); and the Triton version the server reports."""
    onnx = work / "repo" / model / "model.onnx"
    ports = (free_port(), free_port(), free_port())
    widths = (LAYERS[model][0], LAYERS[model][-1])
    argv, env = triton.python_backend_server(venv, work / "triton", onnx, model, widths, MAX_BATCH_SIZE,
                                             ports)
    points, version = triton_points(triton.PYTHON_BACKEND, server("tritonserver", argv, env, work),
                                    ports, model, body, args, work)
    if args.pytriton:
        ports = (free_port(), free_port(), free_port())
        argv = triton.pytriton_argv(venv, onnx.parent.parent, model, *ports, MAX_BATCH_SIZE)
        more, _ = triton_points(triton.PYTRITON, server("pytriton", argv, triton.server_env(venv), work),
                                ports, model, body, args, None)
        points += more
    return points, version


def triton_points(system: str, group: ProcessGroup, ports: tuple[int, int, int], model: str, body: str,
                  args: argparse.Namespace, work: Path | None) -> tuple[list[Point], str]:
    """``system``'s points, once ``group`` (a Triton server) answers on its HTTP port (with
    ``work``, binary and gRPC ones too); its version."""
    base = f"http://127.0.0.1:{ports[0]}"
    url = f"{base}/v2/models/{model}/infer"
    with started([group], lambda: http_ok(url, body.encode())):
        with urllib.request.urlopen(f"{base}/v2", timeout=5) as r:
            version = str(json.load(r)["version"])
        points = [wrk_point(system, url, body, [group], args, c) for c in args.concurrency]
        if work is not None:
            points += binary_points(system, model, url, f"127.0.0.1:{ports[1]}", [group], args, work,
                                    args.binary_concurrency)
        return points, version


def bench_conveyor(model: str, body: str, args: argparse.Namespace, work: Path,
                   api_workers: int) -> list[Point]:
    """conveyor as ``make run`` serves it (``python -m api.serve``, ``api_workers`` API
    processes), under JSON at every concurrency, and binary and gRPC for the default count."""
    api_port, grpc_port = free_port(), free_port()
    base = f"http://127.0.0.1:{api_port}"
    url = f"{base}/v2/models/{model}/infer"
    system = conveyor_system(api_workers)
    with ExitStack() as stack:
        redis = stack.enter_context(RedisServer(work))
        assert redis.proc is not None
        env = {**os.environ, "CONVEYOR_REDIS_URL": redis.url,
               "CONVEYOR_MODEL_REPOSITORY": str(work / "repo"), "CONVEYOR_MODELS": model,
               "CONVEYOR_HTTP_PORT": str(api_port), "CONVEYOR_GRPC_PORT": str(grpc_port),
               "CONVEYOR_WORKER_PORT": str(free_port()), "CONVEYOR_API_WORKERS": str(api_workers),
               "PYTHONUNBUFFERED": "1", **dict(kv.split("=", 1) for kv in args.conveyor_env)}
        groups = [redis.proc,
                  server("api", [sys.executable, "-m", "api.serve"], env, work),
                  server("celery", [sys.executable, "-m", "celery", "-A", "workers.app", "worker",
                                    "-n", f"bench-{api_port}@%h", "--loglevel", "WARNING",
                                    "--without-mingle", "--without-gossip"], env, work)]
        stack.enter_context(started(groups[1:], lambda: http_ok(f"{base}/v2/health/ready")
                                    and http_ok(url, body.encode())))
        points = [wrk_point(system, url, body, groups, args, c) for c in args.concurrency]
        if api_workers == DEFAULT_API:
            points += binary_points(system, model, url, f"127.0.0.1:{grpc_port}", groups, args, work,
                                    args.binary_concurrency)
    return points


def request_body(model: str) -> str:
    rng = random.Random(0)
    width = LAYERS[model][0]
    data = [round(rng.uniform(-1, 1), 4) for _ in range(width)]
    return json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, width],
                                   "data": data}]})


def triton_setup(args: argparse.Namespace) -> tuple[triton.TritonVenv | None, str | None]:
    """Triton's venv, or None and why Triton is skipped."""
    if args.no_triton:
        return None, "--no-triton"
    try:
        return triton.ensure_venv(), None
    except triton.VenvError as exc:
        print(f"skipping Triton: {exc}", file=sys.stderr, flush=True)
        return None, f"its venv could not be created: {str(exc).splitlines()[0][:200]}"


def main() -> None:
    def ints(s: str) -> list[int]:
        return [int(v) for v in s.split(",")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per measured point")
    parser.add_argument("--warmup", type=int, default=2, help="seconds of warm-up per point")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(LAYERS))
    parser.add_argument("--concurrency", type=ints, default=[1, 8, 64])
    parser.add_argument("--api-workers", type=ints, default=sorted({DEFAULT_API, NCPU}),
                        help="CONVEYOR_API_WORKERS values to run conveyor with (binary and gRPC "
                             "rows for the default, half the cores)")
    parser.add_argument("--binary-concurrency", type=ints, default=[1, 64],
                        help="concurrency of the binary-tensor (wrk) and gRPC (h2load) rows")
    parser.add_argument("--pytriton", action="store_true",
                        help="also Triton through pytriton (JSON rows)")
    parser.add_argument("--conveyor-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for conveyor's processes (repeatable)")
    parser.add_argument("--max-other", type=float, default=0.1,
                        help="share of the machine other tenants may use during a point")
    parser.add_argument("--retries", type=int, default=1, help="re-measurements of a noisy point")
    parser.add_argument("--quiet-timeout", type=float, default=10,
                        help="seconds to wait for an idle machine before each point")
    parser.add_argument("--no-triton", action="store_true",
                        help="skip NVIDIA Triton (bench/triton.py and its venv)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = parser.parse_args()
    started_at = datetime.now(UTC)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    results: dict[str, tuple[list[Point], dict[str, int]]] = {}
    triton_venv, triton_skipped = triton_setup(args)
    triton_version: str | None = None
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-") as tmp:
        work = Path(tmp)
        write_repository(work / "repo")
        for model in args.models:
            print(f"{model}:", file=sys.stderr, flush=True)
            body = request_body(model)
            points, raw_rows = raw_points(model, args)
            points += bench_plain(model, body, args, work)
            if triton_venv is not None:
                served, triton_version = bench_triton(model, body, args, work, triton_venv)
                points += served
            for n in args.api_workers:
                points += bench_conveyor(model, body, args, work, n)
            results[model] = (points, raw_rows)
    args.out.write_text(report(results, args, started_at, load, triton_version, triton_skipped))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
