"""Batching policy benchmark for mlp_medium: the window check and an open-loop Poisson sweep.

Usage: python -m bench.sweep [--duration 10] [--warmup 2] [--point-s 8] [--rates 10,30,...]
                             [--out bench/RESULTS-batching.md]

1. Window check: conveyor with `batching: {max_queue_delay_us: 20000, adaptive: true}` under
   wrk at c=1 and c=64, plus mlp_tiny at c=1 (default config) and the raw models' batch-1
   time, so "c=1 p50 within 2 ms of batch-1 time + fixed-path overhead" can be checked.
2. Open loop: Poisson arrivals (asyncio + aiohttp, one keep-alive session) at shares of the
   capacity (conveyor's closed-loop c=64 req/s from step 1) for adaptive, fixed 0 and
   fixed 5000 µs; requests carry `parameters.timeout`, so overload gives 504s.
Servers are started with bench.run's helpers; one system runs at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import redis
import uvloop

from batching.keys import Keys
from batching.settings import Settings
from bench import run as base
from bench.models import write_repository
from bench.run_report import NCPU
from bench.wrk import run_wrk
from conveyor.harness import RedisServer, free_port

MODEL = "mlp_medium"


def set_batching(repo: Path, model: str, delay_us: int, adaptive: bool, target_ms: float) -> None:
    """The model's ``config.yaml``: only this batching section (the rest from the ONNX graph
    and the defaults)."""
    (repo / model / "config.yaml").write_text(f"batching:\n  max_queue_delay_us: {delay_us}\n  adaptive: "
                    f"{str(adaptive).lower()}\n  latency_target_ms: {target_ms:g}\n")


@dataclass
class Server:
    url: str
    stats: redis.Redis
    model: str
    keys: Keys

    def counts(self) -> tuple[int, int]:
        raw = self.stats.hgetall(self.keys.stats(self.model))
        return int(raw.get(b"inference_count", 0)), int(raw.get(b"execution_count", 0))


@contextmanager
def conveyor(model: str, repo: Path, work: Path) -> Iterator[Server]:
    """redis-server + conveyor API + Celery worker serving ``model`` (as bench.run does)."""
    api_port = free_port()
    root = f"http://127.0.0.1:{api_port}"
    url, body = f"{root}/v2/models/{model}/infer", base.request_body(model).encode()
    with ExitStack() as stack:
        rds = stack.enter_context(RedisServer(work))
        env = {**os.environ, "CONVEYOR_REDIS_URL": rds.url,
               "CONVEYOR_MODEL_REPOSITORY": str(repo), "CONVEYOR_MODELS": model,
               "CONVEYOR_GRPC_PORT": str(free_port()), "CONVEYOR_WORKER_PORT": str(free_port()),
               "PYTHONUNBUFFERED": "1"}
        groups = [base.server("api", base.uvicorn_argv(base.CONVEYOR_APP, api_port, factory=True),
                              env, work),
                  base.server("celery", [sys.executable, "-m", "celery", "-A", "workers.app",
                                         "worker", "-n", f"sweep-{api_port}@%h", "--loglevel",
                                         "WARNING", "--without-mingle", "--without-gossip"],
                              env, work)]
        stack.enter_context(base.started(groups, lambda: base.http_ok(f"{root}/v2/health/ready")
                                         and base.http_ok(url, body)))
        client = redis.Redis(port=rds.port)
        stack.callback(client.close)
        yield Server(url, client, model, Keys(Settings().key_prefix))


@dataclass
class Row:
    label: str
    load: str
    offered: float
    achieved: float
    p50_ms: float
    p99_ms: float
    errors: str
    goodput: float | None
    mean_batch: float


def closed(server: Server, label: str, c: int, seconds: int, warmup: int) -> Row:
    body = base.request_body(server.model)
    run_wrk(server.url, body, connections=c, duration_s=warmup)
    base.wait_quiet(3)
    inf0, exe0 = server.counts()
    res = run_wrk(server.url, body, connections=c, duration_s=seconds)
    inf1, exe1 = server.counts()
    row = Row(label, f"closed c={c}", float("nan"), res["rps"], res["p50_ms"], res["p99_ms"],
              str(res["errors"]), None, (inf1 - inf0) / max(exe1 - exe0, 1))
    print(f"  {label} c={c}: {row.achieved:.0f} req/s p50 {row.p50_ms:.2f} p99 {row.p99_ms:.2f} "
          f"batch {row.mean_batch:.1f}", file=sys.stderr, flush=True)
    return row


def pct(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))] if sorted_ms else float("nan")


async def poisson(url: str, body: bytes, rate: float, warmup_s: float, seconds: float,
                  client_timeout_s: float) -> tuple[list[float], dict[str, int], int]:
    """Send at Poisson ``rate``; latency counts from the scheduled send time (no omission).

    Returns the latencies (ms) of the 200s, error counts by kind and the number sent, for the
    requests scheduled in the measured ``seconds`` after ``warmup_s``.
    """
    ok_ms: list[float] = []
    errors = {"503": 0, "504": 0, "other": 0}
    sent = 0
    rng = random.Random(1)
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=4096)
    timeout = aiohttp.ClientTimeout(total=client_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def one(at: float, counted: bool) -> None:
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError):
                status = -1
            if not counted:
                return
            if status == 200:
                ok_ms.append((time.perf_counter() - at) * 1e3)
            else:
                errors[str(status) if status in (503, 504) else "other"] += 1

        tasks: set[asyncio.Task[None]] = set()
        start = time.perf_counter()
        at, end = start, start + warmup_s + seconds
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                break
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            counted = at >= start + warmup_s
            sent += counted
            task = asyncio.create_task(one(at, counted))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
    return sorted(ok_ms), errors, sent


def open_point(server: Server, label: str, share: float, capacity: float,
               args: argparse.Namespace) -> Row:
    body = json.loads(base.request_body(server.model))
    body["parameters"] = {"timeout": args.timeout_us}
    rate = share * capacity
    inf0, exe0 = server.counts()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        ok_ms, errors, sent = runner.run(poisson(server.url, json.dumps(body).encode(), rate,
                                                 args.point_warmup, args.point_s, 10.0))
    inf1, exe1 = server.counts()
    good = sum(ms <= args.latency_target_ms for ms in ok_ms)
    row = Row(label, f"{share:.0%}", sent / args.point_s, len(ok_ms) / args.point_s,
              pct(ok_ms, 0.5), pct(ok_ms, 0.99), "/".join(map(str, errors.values())),
              good / args.point_s, (inf1 - inf0) / max(exe1 - exe0, 1))
    print(f"  {label} {row.load}: offered {row.offered:.0f} achieved {row.achieved:.0f} "
          f"p50 {row.p50_ms:.1f} p99 {row.p99_ms:.1f} goodput {good / args.point_s:.0f} "
          f"err {row.errors} batch {row.mean_batch:.1f}", file=sys.stderr, flush=True)
    return row


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or value != value else f"{value:,.{digits}f}"


def table(rows: list[Row], open_loop: bool) -> list[str]:
    if open_loop:
        out = ["| config | load | offered req/s | achieved req/s (200s) | p50 ms | p99 ms | "
               "goodput req/s | errors 503/504/other | mean batch |", "|---|---|---|---|---|---|---|---|---|"]
        return out + [f"| {r.label} | {r.load} | {fmt(r.offered, 0)} | {fmt(r.achieved, 0)} | "
                      f"{fmt(r.p50_ms)} | {fmt(r.p99_ms)} | {fmt(r.goodput, 0)} | {r.errors} | "
                      f"{fmt(r.mean_batch)} |" for r in rows]
    out = ["| system | load | req/s | p50 ms | p99 ms | errors | mean batch |",
           "|---|---|---|---|---|---|---|"]
    return out + [f"| {r.label} | {r.load} | {fmt(r.achieved, 0)} | {fmt(r.p50_ms, 2)} | "
                  f"{fmt(r.p99_ms, 2)} | {r.errors} | {fmt(r.mean_batch)} |" for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per closed-loop point")
    parser.add_argument("--tiny-duration", type=int, default=5, help="seconds for mlp_tiny c=1")
    parser.add_argument("--warmup", type=int, default=2, help="closed-loop warm-up seconds")
    parser.add_argument("--point-s", type=float, default=8, help="seconds per open-loop point")
    parser.add_argument("--point-warmup", type=float, default=1, help="open-loop warm-up seconds")
    parser.add_argument("--rates", type=lambda s: [int(v) / 100 for v in s.split(",")],
                        default=[0.1, 0.3, 0.5, 0.7, 0.9, 1.1, 1.2], help="%% of capacity")
    parser.add_argument("--fixed", type=lambda s: [int(v) for v in s.split(",")], default=[0, 5000],
                        help="max_queue_delay_us values of the fixed windows")
    parser.add_argument("--timeout-us", type=int, default=1_000_000, help="parameters.timeout")
    parser.add_argument("--latency-target-ms", type=float, default=50.0)
    parser.add_argument("--out", type=Path, default=base.ROOT / "bench" / "RESULTS-batching.md")
    args = parser.parse_args()
    started_at = datetime.now(UTC)
    load0 = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    raw = {}
    for line in subprocess.run([sys.executable, "-m", "bench.raw_model", MODEL, "mlp_tiny"], cwd=base.ROOT,
                               capture_output=True, text=True, check=True).stdout.splitlines():
        entry = json.loads(line)
        raw[entry["model"]] = entry
    print(f"raw: {json.dumps(raw)}", file=sys.stderr, flush=True)
    target = args.latency_target_ms
    with tempfile.TemporaryDirectory(prefix="conveyor-sweep-") as tmp:
        work = Path(tmp)
        repo = work / "repo"
        write_repository(repo)
        with conveyor("mlp_tiny", repo, work) as server:
            tiny = closed(server, "conveyor mlp_tiny (default config)", 1, args.tiny_duration,
                          args.warmup)
        set_batching(repo, MODEL, 20000, True, target)
        sweep: dict[str, list[Row]] = {}
        with conveyor(MODEL, repo, work) as server:
            window = [closed(server, "conveyor adaptive 20 ms", c, args.duration, args.warmup)
                      for c in (1, 64)]
            capacity = window[1].achieved
            sweep["adaptive 20 ms"] = [open_point(server, "adaptive 20 ms", s, capacity, args)
                                       for s in args.rates]
        for delay in args.fixed:
            set_batching(repo, MODEL, delay, False, target)
            label = f"fixed {delay} µs"
            with conveyor(MODEL, repo, work) as server:
                sweep[label] = [open_point(server, label, s, capacity, args) for s in args.rates]
    fixed = [k for k in sweep if k.startswith("fixed")]
    best = max(fixed, key=lambda k: sum(r.goodput or 0 for r in sweep[k]))
    overhead = tiny.p50_ms - raw["mlp_tiny"]["batch1_p50_ms"]
    bound = raw[MODEL]["batch1_p50_ms"] + overhead + 2.0
    c1 = window[0].p50_ms
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    lines = [
        f"## Batching policy ({MODEL})", "",
        f"- date: {started_at:%Y-%m-%d %H:%M} UTC; load average at start / end: {load0} / "
        + " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        f"- machine: {NCPU} CPUs, {cpu}, Linux {os.uname().release}, Python {sys.version.split()[0]}"
        "; shared with other tenants, and the load generator runs on the same box",
        f"- command: `{' '.join(['python -m bench.sweep', *sys.argv[1:]])}`",
        "- conveyor: 1 API process, 1 Celery worker (1 inference process, 1 torch thread), own "
        f"redis-server; mlp_medium config `batching: {{max_queue_delay_us: …, adaptive: …, "
        f"latency_target_ms: {target:g}}}`, queue defaults (max_queue_rows 10000)", "",
        "### Window check (closed loop, wrk)", "",
        f"`wrk -t1 -c<c> -d{args.duration}s` after {args.warmup}s warm-up (mlp_tiny: "
        f"{args.tiny_duration}s). Mean batch = Δinference_count / Δexecution_count of "
        f"`cv:{{model}}:stats` over the measured run.", "",
        *table([tiny, *window], open_loop=False), "",
        f"- raw batch-1 time (bench.raw_model, median): {MODEL} "
        f"{raw[MODEL]['batch1_p50_ms']:.2f} ms, mlp_tiny {raw['mlp_tiny']['batch1_p50_ms']:.3f} ms; "
        f"{MODEL} best batch {raw[MODEL]['best_batch']}: {raw[MODEL]['best_rows_per_s']:,} rows/s",
        f"- fixed-path overhead = tiny c=1 p50 − tiny batch-1 = {overhead:.2f} ms",
        f"- c=1 p50 {c1:.2f} ms vs batch-1 + overhead + 2 ms = {bound:.2f} ms: "
        + ("**within**" if c1 <= bound else "**not within**"), "",
        "### Open loop (Poisson arrivals)", "",
        f"Capacity = conveyor's closed-loop c=64 throughput above ({capacity:.0f} req/s; the raw "
        f"model's best is {raw[MODEL]['best_rows_per_s']:,} rows/s). {args.point_s:g}s per point "
        f"after {args.point_warmup:g}s at the same rate; latency from the scheduled send time; "
        f"`parameters.timeout` {args.timeout_us} µs; goodput = 200s within {target:g} ms per s. "
        "Python asyncio + aiohttp, one keep-alive session.", "",
        *table([r for rows in sweep.values() for r in rows], open_loop=True), "",
        f"Best fixed (most goodput summed over the rates): **{best}**.", "",
        "| load | adaptive goodput | best fixed goodput | adaptive p99 ms | best fixed p99 ms |",
        "|---|---|---|---|---|",
        *[f"| {a.load} | {fmt(a.goodput, 0)} | {fmt(b.goodput, 0)} | {fmt(a.p99_ms)} | "
          f"{fmt(b.p99_ms)} |" for a, b in zip(sweep["adaptive 20 ms"], sweep[best], strict=True)], "",
    ]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
