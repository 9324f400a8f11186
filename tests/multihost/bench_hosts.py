"""A 150 KB image between hosts: what it costs Redis and how many a second one API process
and one inference process answer, with the image through Redis and fetched from the API.

Run as root (network namespaces, tests/multihost/netns.py)::

    python -m tests.multihost.bench_hosts [--duration S] [--concurrency C] [--inputs redis auto]

A Redis host, an API host, a worker host (each API and worker host with a ``/dev/shm`` of
its own) and a client host on one switch. ``image_mean`` (bench/redis_cost.py: a
224x224x3 UINT8 image in, its channel means out) is loaded with wrk from the client host,
first with ``CONVEYOR_TENSOR_TRANSPORT=redis`` (what crossing hosts cost before the bytes
endpoint), then with the default ``auto``, which between hosts fetches the image from the
API process. Per request: Redis's main-thread CPU (also less what it spends idle, per
second, over the requests of a second), the bytes it read, the CPU of the API process and
of the worker (its inference process and Celery's), and Redis's commands (calls and their
own µs, ``INFO commandstats``). Every host shares this machine's cores: the load average
at the end of each run is printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import cast

from batching.keys import Keys
from bench.redis_cost import IMAGE, write_repository
from conveyor.bench_load import REQUEST_TIMEOUT_S, parse_wrk, wrk_script
from conveyor.bench_request import binary_body
from tests.multihost.netns import Host, Network, sweep_leftovers, unavailable
from tests.multihost.services import API_PORT, Services
from tests.procs import ROOT, Proc, wait_for

MODEL = "image_mean"
IDLE_S = 3.0
"""How long Redis's main thread is measured with nothing sent (heartbeats, blocking reads,
the API's watch): the work every request of a run shares."""


def ready(services: Services, keys: Keys) -> bool:
    """The model's inference process beats ``ready``."""
    with services.client() as client:
        beats = cast(dict[bytes, bytes], client.hgetall(keys.workers(MODEL)))
    return any(json.loads(v).get("state") == "ready" for k, v in beats.items()
               if not k.endswith(b":slot"))


def command_costs(services: Services, requests: int) -> str:
    """Redis's commands since its statistics were last reset: calls and µs of each, per
    request, the costliest first (a script's calls counted under it and on their own)."""
    with services.client() as client:
        stats = cast(dict[str, dict[str, int]], client.info("commandstats"))
    rows = sorted(((int(v["usec"]) / requests, int(v["calls"]) / requests,
                   name.removeprefix("cmdstat_")) for name, v in stats.items()
                  if not name.startswith(("cmdstat_info", "cmdstat_config"))), reverse=True)
    return ", ".join(f"{name} {calls:.2f} ({us:.1f} µs)" for us, calls, name in rows
                     if calls >= 0.01)


def counters(services: Services) -> tuple[float, int]:
    """Redis's main-thread CPU (s) and the bytes it has read."""
    with services.client() as client:
        info = client.info()
    return (float(info["used_cpu_sys_main_thread"]) + float(info["used_cpu_user_main_thread"]),
            int(info["total_net_input_bytes"]))


def group_cpu(pgid: int) -> float:
    """CPU seconds (user and system) the live processes of process group ``pgid`` used."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp, ..., utime, stime
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def wrk(client: Host, url: str, body_dir: Path, args: argparse.Namespace, duration: int) -> str:
    """wrk on the client host against ``url``; its output."""
    argv = client.argv(["wrk", "-t", "2", "-c", str(args.concurrency), "-d", f"{duration}s",
                        "--timeout", f"{REQUEST_TIMEOUT_S}s", "--latency",
                        "-s", str(body_dir / "request.lua"), url])
    return subprocess.run(argv, capture_output=True, text=True, check=True,
                          timeout=duration + 60).stdout


def measure(path: str, hosts: dict[str, Host], services: Services, repo: Path, work: Path,
            args: argparse.Namespace) -> tuple[str, str]:
    """One API and one worker with ``path``; a table row, and Redis's commands a request."""
    prefix = f"hb{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "CONVEYOR_REDIS_URL": services.redis_url, "CONVEYOR_KEY_PREFIX": prefix,
           "CONVEYOR_MODEL_REPOSITORY": str(repo), "CONVEYOR_MODELS": MODEL,
           "CONVEYOR_TENSOR_TRANSPORT": path, "PYTHONUNBUFFERED": "1"}
    api_host, worker_host = hosts["api"], hosts["worker"]
    api = Proc(f"api-{path}", api_host.argv([sys.executable, "-m", "api.serve"], own_shm=True),
               {**env, "CONVEYOR_HOST": api_host.address, "CONVEYOR_ALLOW_UNAUTHENTICATED": "1",
                "CONVEYOR_HTTP_PORT": str(API_PORT), "CONVEYOR_GRPC_PORT": str(API_PORT + 1),
                "CONVEYOR_API_WORKERS": "1"}, work)
    worker = Proc(f"worker-{path}", worker_host.argv(
        [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-n", f"{prefix}@%h",
         "--loglevel", "WARNING", "--without-mingle", "--without-gossip"], own_shm=True),
        {**env, "CONVEYOR_HOST": "127.0.0.1", "CONVEYOR_WORKER_PORT": "8002"}, work)
    try:
        wait_for(lambda: ready(services, Keys(prefix)), 180, "the inference process")
        url = f"http://{api_host.address}:{API_PORT}/v2/models/{MODEL}/infer"
        wrk(hosts["client"], url, work, args, 3)  # warm-up; the API sees the heartbeat
        idle0, _ = counters(services)
        time.sleep(IDLE_S)
        idle = (counters(services)[0] - idle0) / IDLE_S
        with services.client() as client:
            client.config_resetstat()
        cpu0, in0 = counters(services)
        own0 = group_cpu(api.pid), group_cpu(worker.pid)
        out = parse_wrk(wrk(hosts["client"], url, work, args, args.duration))
        cpu1, in1 = counters(services)
        own1 = group_cpu(api.pid), group_cpu(worker.pid)
        commands = command_costs(services, max(out.requests, 1))
    finally:
        api.kill_group()
        worker.kill_group()
    if out.errors:
        raise RuntimeError(f"{path}: {out.errors} requests failed\n{api.tail()}{worker.tail()}")
    n = out.requests
    per_request = (cpu1 - cpu0) * 1e6 / n
    beside = idle * 1e6 / out.throughput  # what the idle work adds to each request
    return (f"| {path} | {n:,} | {out.throughput:,.0f} | {per_request:.1f} | "
            f"{idle * 1e3:.1f} | {per_request - beside:.1f} | {(in1 - in0) / n:,.0f} | "
            f"{out.p50_ms or 0:.1f} | {(own1[0] - own0[0]) * 1e6 / n:.0f} | "
            f"{(own1[1] - own0[1]) * 1e6 / n:.0f} | {os.getloadavg()[0]:.1f} |"), \
        f"- {path}: {commands}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--inputs", nargs="+", choices=("redis", "auto", "fetch"),
                        default=["redis", "auto"], help="the transports measured, in turn")
    args = parser.parse_args()
    why = unavailable()
    if why is not None:
        print(f"bench_hosts: {why}", file=sys.stderr)
        return 2
    sweep_leftovers()
    network = Network()
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-hosts-") as tmp:
        work = Path(tmp)
        tensor = write_repository(work / "repo")[MODEL]
        body = binary_body([tensor])
        (work / "body").write_bytes(body.content)
        (work / "request.lua").write_text(wrk_script(work / "body", body.headers))
        services = Services(work, "hb")
        try:
            network.open()
            hosts = {name: network.add(name) for name in ("redis", "api", "worker", "client")}
            services.start_redis(hosts["redis"])
            rows = [measure(path, hosts, services, work / "repo", work, args)
                    for path in args.inputs]
        finally:
            services.stop()
            network.remove()
    print(f"image_mean ({'x'.join(map(str, IMAGE))} UINT8, {len(body.content):,} bytes a "
          f"request), c={args.concurrency}, {args.duration}s, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; `python -m "
          f"tests.multihost.bench_hosts {' '.join(sys.argv[1:])}`\n")
    print("| inputs | requests | req/s | Redis main thread µs / request | idle, ms / s | "
          "µs / request less idle | Redis bytes in / request | p50 ms | API CPU µs / request | "
          "worker CPU µs / request | load average |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(row for row, _ in rows))
    print("\nRedis's commands a request: calls (their µs)\n")
    print("\n".join(commands for _, commands in rows))
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
