"""One benchmark run, side by side (DESIGN section 11): raw model, plain FastAPI wrapper, conveyor.

Usage: python -m bench.run [--duration S] [--warmup S] [--models mlp_tiny,mlp_medium]
                           [--concurrency 1,8,64] [--api-workers 1,2] [--out bench/RESULTS.md]

Per model: the raw in-process model (bench.raw_model), then the plain wrapper under one
uvicorn process, then conveyor (redis-server + API + Celery worker) once per API process
count, each under wrk at every concurrency. Only one system runs at a time. CPU seconds are
read from /proc for each server's process group during the measured run only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench.models import LAYERS, write_repository
from bench.wrk import run_wrk

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_ok(url: str, body: bytes | None = None) -> bool:
    headers = {"content-type": "application/json"} if body is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=5) as r:
            return bool(r.status == 200)
    except OSError:  # URLError and HTTPError are OSErrors
        return False


def redis_pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class Group:
    """A server started in its own session, so its whole process tree shares one pgid."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: Path,
                 child_name: str | None = None) -> None:
        self.name, self.child_name = name, child_name or name
        self.log_path = logdir / f"{name}-{time.monotonic_ns()}.log"
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self) -> str:
        return f"--- {self.name} log:\n{self.log_path.read_text(errors='replace')[-3000:]}"

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}\n{self.log_tail()}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.popen.wait(20)
        with suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # stragglers of the group
        self.popen.wait(5)


@contextmanager
def started(groups: list[Group], ready: Callable[[], bool], timeout: float = 120) -> Iterator[None]:
    """Wait until ``ready`` holds (failing fast if a server dies), stop every group on exit."""
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            for group in groups:
                group.check_alive()
            if time.monotonic() > deadline:
                logs = "\n".join(g.log_tail() for g in groups)
                raise RuntimeError(f"{[g.name for g in groups]} not ready after {timeout:.0f}s\n{logs}")
            time.sleep(0.2)
        yield
    finally:
        for group in reversed(groups):
            group.stop()


def cpu_by_label(groups: list[Group]) -> dict[str, float]:
    """utime+stime (s) of every live process in the groups, summed per label."""
    labels = {g.popen.pid: g for g in groups}
    totals: dict[str, float] = defaultdict(float)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # fields from the 3rd (state) on
        group = labels.get(int(fields[2]))  # pgrp
        if group is not None:
            label = group.name if int(entry.name) == group.popen.pid else group.child_name
            totals[label] += (int(fields[11]) + int(fields[12])) / TICKS
    return totals


def machine_busy_s() -> float:
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / TICKS  # minus idle and iowait


def wait_quiet(timeout: float, max_busy: float = 0.3) -> None:
    """Wait (up to ``timeout``) until other tenants leave the machine nearly idle for a second."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy0 = machine_busy_s()
        time.sleep(1.0)
        if machine_busy_s() - busy0 < max_busy:
            return
    print(f"  machine still busy after {timeout:.0f}s: measuring anyway", file=sys.stderr)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


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
    other_cpu_s: float | None = None


def measure(system: str, url: str, body: str, groups: list[Group], args: argparse.Namespace,
            concurrency: int) -> Point:
    wait_quiet(args.quiet_timeout)
    run_wrk(url, body, connections=concurrency, duration_s=args.warmup)
    cpu0, busy0, kids0 = cpu_by_label(groups), machine_busy_s(), children_cpu_s()
    result = run_wrk(url, body, connections=concurrency, duration_s=args.duration)
    cpu1, busy1, kids1 = cpu_by_label(groups), machine_busy_s(), children_cpu_s()
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
    wrk_s = kids1 - kids0
    point = Point(system, str(concurrency), result["rps"], result["p50_ms"], result["p99_ms"],
                  result["errors"], cpu, wrk_s, busy1 - busy0 - sum(cpu.values()) - wrk_s)
    print(f"  {system:<24} c={concurrency:<3} {point.rps:9.0f} req/s  p50 {point.p50_ms:7.2f} ms"
          f"  p99 {result['p99_ms']:7.2f} ms  errors {result['errors']}  "
          f"cpu {sum(cpu.values()):.1f}s", file=sys.stderr, flush=True)
    return point


def request_body(model: str) -> str:
    rng = random.Random(0)
    width = LAYERS[model][0]
    data = [round(rng.uniform(-1, 1), 4) for _ in range(width)]
    return json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, width],
                                   "data": data}]})


def raw_points(model: str) -> tuple[list[Point], dict[str, int]]:
    out = subprocess.run([sys.executable, "-m", "bench.raw_model", model], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    raw = json.loads(out.strip().splitlines()[-1])
    rows: dict[str, int] = raw["rows_per_s"]
    best = raw["best_batch"]
    return [Point("raw model, batch 1", "-", rows["1"], raw["batch1_p50_ms"]),
            Point(f"raw model, batch {best}", "-", raw["best_rows_per_s"],
                  1e3 * best / raw["best_rows_per_s"])], rows


def uvicorn_argv(app: str, port: int, workers: int = 1) -> list[str]:
    return [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
            "--no-access-log", "--log-level", "warning", "--workers", str(workers)]


def bench_plain(model: str, body: str, args: argparse.Namespace, logdir: Path) -> list[Point]:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v2/models/{model}/infer"
    env = {**os.environ, "BENCH_MODEL": model, "PYTHONUNBUFFERED": "1"}
    groups = [Group("plain", uvicorn_argv("bench.plain_fastapi:app", port), env, logdir)]
    with started(groups, lambda: http_ok(url, body.encode())):
        return [measure("plain FastAPI", url, body, groups, args, c) for c in args.concurrency]


def bench_conveyor(model: str, body: str, args: argparse.Namespace, logdir: Path, repo: Path,
                   api_workers: int) -> list[Point]:
    redis_port, api_port = free_port(), free_port()
    base = f"http://127.0.0.1:{api_port}"
    url = f"{base}/v2/models/{model}/infer"
    env = {**os.environ, "CONVEYOR_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
           "CONVEYOR_MODEL_REPOSITORY": str(repo), "CONVEYOR_MODELS": model,
           "PYTHONUNBUFFERED": "1"}
    system = f"conveyor, {api_workers} API proc{'s' if api_workers > 1 else ''}"
    with ExitStack() as stack:
        redis = Group("redis", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                "--save", "", "--appendonly", "no", "--dir", str(logdir)],
                      env, logdir)
        stack.enter_context(started([redis], lambda: redis_pings(redis_port), 10))
        groups = [
            redis,
            Group("api", uvicorn_argv("api.main:app", api_port, api_workers), env, logdir),
            Group("celery", [sys.executable, "-m", "celery", "-A", "workers.app", "worker",
                             "-n", f"bench-{api_port}@%h", "--loglevel", "WARNING",
                             "--without-mingle", "--without-gossip"],
                  env, logdir, child_name="inference"),
        ]
        stack.enter_context(started(groups[1:], lambda: http_ok(f"{base}/v2/health/ready")
                                    and http_ok(url, body.encode())))
        points = [measure(system, url, body, groups, args, c) for c in args.concurrency]
    return points


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def cpu_cell(point: Point) -> tuple[str, str]:
    if not point.cpu:
        return "-", "-"
    split = ", ".join(f"{k} {v:.1f}" for k, v in sorted(point.cpu.items(), key=lambda kv: -kv[1]))
    return fmt(sum(point.cpu.values()), 1), split if len(point.cpu) > 1 else ""


def best_conveyor(points: list[Point], concurrency: str) -> Point | None:
    at = [p for p in points if p.system.startswith("conveyor") and p.concurrency == concurrency]
    return max(at, key=lambda p: p.rps, default=None)


def report(results: dict[str, tuple[list[Point], dict[str, int]]], args: argparse.Namespace,
           started_at: datetime, load: str) -> str:
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "unknown")
    lines = [
        "# conveyor benchmark results", "",
        f"- date: {started_at:%Y-%m-%d %H:%M} UTC",
        f"- machine: {os.cpu_count()} CPUs (nproc), {cpu_model}, {os.uname().release}, "
        f"Python {sys.version.split()[0]}",
        f"- command: `{' '.join(['python -m bench.run', *sys.argv[1:]])}`",
        f"- load: `wrk -t1 -cC -d{args.duration}s` after a {args.warmup}s warm-up at the same "
        "concurrency, wrk on the same box; one system running at a time, each point started "
        "once the machine was idle for a second (or after --quiet-timeout)",
        f"- load average when the run started: {load}",
        "- CPU s: utime+stime of the server's processes during the measured run (from /proc); "
        "wrk CPU s: wrk itself; other CPU s: the rest of the machine's busy time in that "
        "window (other tenants: a noise indicator, should be ~0)",
        "- raw model rows: one thread, in-process, no serving stack; req/s means rows/s and "
        "p50 is one call (batch N: per-call time of the best batch)", "",
    ]
    ratio_rows = []
    for model, (points, raw_rows) in results.items():
        lines += [f"## {model}", "",
                  "raw rows/s by batch size: " + ", ".join(f"{b}: {r:,}" for b, r in raw_rows.items()),
                  "", "| system | c | req/s | p50 ms | p99 ms | errors | CPU s | CPU split "
                  "| wrk CPU s | other CPU s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for p in points:
            cpu_total, split = cpu_cell(p)
            errors = "-" if p.errors is None else str(p.errors)
            lines.append(f"| {p.system} | {p.concurrency} | {fmt(p.rps, 0)} | {fmt(p.p50_ms)} | "
                         f"{fmt(p.p99_ms)} | {errors} | {cpu_total} | {split} | "
                         f"{fmt(p.wrk_cpu_s, 1)} | {fmt(p.other_cpu_s, 1)} |")
        lines.append("")
        top = str(max(args.concurrency))
        conv = best_conveyor(points, top)
        plain = next((p for p in points if p.system == "plain FastAPI" and p.concurrency == top),
                     None)
        if conv and plain:
            target = {"mlp_medium": 5.0, "mlp_tiny": 2.0}.get(model)
            ratio = conv.rps / plain.rps
            met = "-" if target is None else ("yes" if ratio >= target else "**no**")
            ratio_rows.append(f"| {model}: conveyor / plain req/s at c={top} | {ratio:.2f}× "
                              f"({conv.system}) | {'-' if target is None else f'≥{target:g}×'} "
                              f"| {met} |")
        c1 = best_conveyor(points, "1")
        if model == "mlp_tiny" and c1:
            met = "yes" if c1.p50_ms < 1.0 else "**no**"
            ratio_rows.append(f"| mlp_tiny: conveyor p50 at c=1 | {c1.p50_ms:.2f} ms "
                              f"({c1.system}) | < 1 ms | {met} |")
    lines += ["## Ratios against the targets", "", "| what | measured | target | met |",
              "|---|---|---|---|", *ratio_rows, "",
              "Conveyor rows use the API process count that was faster at that concurrency.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per measured point")
    parser.add_argument("--warmup", type=int, default=2, help="seconds of warm-up per point")
    parser.add_argument("--quiet-timeout", type=float, default=60,
                        help="seconds to wait for an idle machine before each point")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(LAYERS))
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")],
                        default=[1, 8, 64])
    parser.add_argument("--api-workers", type=lambda s: [int(c) for c in s.split(",")],
                        default=[1, 2], help="uvicorn --workers values to run conveyor with")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = parser.parse_args()
    started_at = datetime.now(UTC)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    results: dict[str, tuple[list[Point], dict[str, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-") as tmp:
        work = Path(tmp)
        write_repository(work / "repo")
        for model in args.models:
            print(f"{model}:", file=sys.stderr, flush=True)
            body = request_body(model)
            points, raw_rows = raw_points(model)
            points += bench_plain(model, body, args, work)
            for n in args.api_workers:
                points += bench_conveyor(model, body, args, work, work / "repo", n)
            results[model] = (points, raw_rows)
    args.out.write_text(report(results, args, started_at, load))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
