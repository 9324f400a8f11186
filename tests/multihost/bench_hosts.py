"""A 150 KB image between hosts: what it costs Redis and how many a second one API process
and one inference process answer, with the image through Redis and fetched from the API.

Run as root (network namespaces, tests/multihost/netns.py)::

    python -m tests.multihost.bench_hosts [--duration S] [--concurrency C] [--inputs redis auto]

A Redis host, an API host, a worker host (each API and worker host with a ``/dev/shm`` of
its own) and a client host on one switch. ``image_mean`` (bench/redis_cost.py: a
224x224x3 UINT8 image in, its channel means out) is loaded with wrk from the client host,
one connection a wrk thread, so that each answer is checked against the image its
connection sent: ``IMAGES`` images whose channel means differ, taken in turn, starting at
another for each connection (a request answered with another's result, or with bytes
other than its own, fails the run). First with ``CONVEYOR_TENSOR_TRANSPORT=redis`` (what
crossing hosts cost before the bytes endpoint), then with the default ``auto``, which between
hosts fetches the image from the
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
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import cast

import numpy as np

from batching.keys import Keys
from bench.redis_cost import IMAGE, write_repository
from conveyor.bench_load import REQUEST_TIMEOUT_S, lua_string, parse_wrk, wrk_post
from conveyor.bench_request import Input, binary_body
from tests.multihost.netns import Host, Network, sweep_leftovers, unavailable
from tests.multihost.services import API_PORT, Services
from tests.procs import ROOT, Proc, wait_for

MODEL = "image_mean"
IMAGES = 16
"""Distinct images the load takes in turn (16 * 150 KB in each wrk thread's Lua state)."""
SPREAD = 30
"""Each pixel of image ``k`` is its channel's level plus or minus this, half of each, in a
random order: the image's bytes vary, its channel means are exact integers."""
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


def levels(k: int) -> tuple[int, int, int]:
    """Image ``k``'s channel means."""
    return 40 + 10 * k, 45 + 10 * k, 50 + 10 * k


def write_images(work: Path) -> dict[str, str]:
    """``IMAGES`` request bodies (``body<k>``) and the raw FP32 output each must be answered
    with (``answer<k>``) in ``work``; the bodies' headers (the same for all)."""
    rng = np.random.default_rng(0)
    pixels = IMAGE[0] * IMAGE[1]
    signs = np.repeat(np.array([-1, 1], dtype=np.int16), pixels // 2)
    headers: dict[str, str] = {}
    for k in range(IMAGES):
        channels = [level + SPREAD * rng.permutation(signs) for level in levels(k)]
        image = np.stack(channels, axis=-1).astype(np.uint8).reshape(1, *IMAGE)
        body = binary_body([Input("INPUT0", "UINT8", image)])
        (work / f"body{k}").write_bytes(body.content)
        (work / f"answer{k}").write_bytes(np.array(levels(k), dtype="<f4").tobytes())
        headers = body.headers
    return headers


def checked_script(work: Path, headers: dict[str, str]) -> str:
    """wrk's Lua: each thread (one connection) sends the images in turn, from its own
    first, checks each answer's output bytes against its image's, and the main state
    prints ``checked: <right> right, <wrong> wrong`` at the end."""
    return wrk_post(headers) + f"""
local dir = {lua_string(str(work))}
local images = {IMAGES}
local function slurp(name)
  local file = assert(io.open(dir .. "/" .. name, "rb"))
  local text = file:read("*a")
  file:close()
  return text
end
local threads = {{}}
function setup(thread)
  table.insert(threads, thread)
  thread:set("id", #threads)
end
function init(args)
  requests, answers = {{}}, {{}}
  for k = 1, images do
    requests[k] = wrk.format(nil, nil, nil, slurp("body" .. (k - 1)))
    answers[k] = slurp("answer" .. (k - 1))
  end
  turn, pending, right, wrong = id % images, nil, 0, 0
end
function request()
  turn = turn % images + 1
  pending = turn
  return requests[turn]
end
function response(status, headers, body)
  local size = #answers[1]
  if status == 200 and pending ~= nil and body:sub(-size) == answers[pending] then
    right = right + 1
  else
    wrong = wrong + 1
  end
  pending = nil
end
function done(summary, latency, requests)
  local right, wrong = 0, 0
  for _, thread in ipairs(threads) do
    right = right + thread:get("right")
    wrong = wrong + thread:get("wrong")
  end
  io.write(string.format("checked: %d right, %d wrong\\n", right, wrong))
end
"""


def checked(output: str) -> tuple[int, int]:
    """The answers the script found right and wrong."""
    found = re.search(r"^checked: (\d+) right, (\d+) wrong$", output, re.M)
    if found is None:
        raise RuntimeError(f"wrk printed no check:\n{output}")
    return int(found[1]), int(found[2])


def wrk(client: Host, url: str, body_dir: Path, args: argparse.Namespace, duration: int) -> str:
    """wrk on the client host against ``url``, a thread for each connection; its output."""
    argv = client.argv(["wrk", "-t", str(args.concurrency), "-c", str(args.concurrency),
                        "-d", f"{duration}s",
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
        report = wrk(hosts["client"], url, work, args, args.duration)
        out = parse_wrk(report)
        right, wrong = checked(report)
        cpu1, in1 = counters(services)
        own1 = group_cpu(api.pid), group_cpu(worker.pid)
        commands = command_costs(services, max(out.requests, 1))
    finally:
        api.kill_group()
        worker.kill_group()
    if out.errors or wrong or right != out.requests:
        raise RuntimeError(f"{path}: {out.errors} requests failed, {wrong} answers wrong, "
                           f"{right} of {out.requests} right\n{api.tail()}{worker.tail()}")
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
        write_repository(work / "repo")
        headers = write_images(work)
        size = (work / "body0").stat().st_size
        (work / "request.lua").write_text(checked_script(work, headers))
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
    print(f"image_mean ({'x'.join(map(str, IMAGE))} UINT8, {size:,} bytes a request, "
          f"{IMAGES} images, every answer checked), c={args.concurrency}, "
          f"{args.duration}s, {os.cpu_count()} CPUs, "
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
