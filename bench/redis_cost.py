"""What one inference request costs Redis: commands, bytes in and out, and server CPU.

Usage: python -m bench.redis_cost [--duration S] [--concurrency C] [--io-threads N [N...]]
                                  [--paths redis fetch] [--out bench/RESULTS-redis.md]

Serves two models through conveyor (``python -m api.serve`` with one API process, a
Celery worker, an own redis-server): mlp_tiny (ONNX, 64 FP32 in, 10 out: a 256-byte tensor)
and ``image_mean`` (Python, numpy), a 224x224x3 UINT8 image in (150,528 bytes, ResNet-50's
input) and its 3 channel means out. Each is loaded with the binary tensor extension (wrk,
closed loop); Redis's
own counters (``INFO commandstats``, ``total_net_input_bytes`` / ``total_net_output_bytes``,
``used_cpu_sys`` + ``used_cpu_user``), reset before and read after, are divided by the
requests answered. From the main thread's CPU per request (``used_cpu_*_main_thread``): the
request rate at which one Redis core (the main thread, which runs every command) would be
saturated. Of that CPU, the part spent executing commands is ``INFO commandstats``' time
of the commands sent (a script's time includes the commands it calls, which are counted
once); the rest is reading, parsing and writing. ``--io-threads 1 2`` measures each model
with Redis's own default and again with two I/O threads that also read
(``io-threads-do-reads yes``), counting the reads and writes they took
(``io_threaded_reads_processed``, ``io_threaded_writes_processed``). The tensor arena is
never used: the image goes the ways it can between hosts, ``--paths``: through Redis
(``CONVEYOR_TENSOR_TRANSPORT=redis``), and fetched by the inference process from the API
process's bytes endpoint (``fetch``, the default between hosts, docs/data-path.md); the
small mlp_tiny input always goes through Redis.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import redis

from api.admission import LARGE_ENTRY_BYTES
from bench.models import export_onnx
from conveyor.bench_load import run_wrk
from conveyor.bench_request import Input, binary_body
from conveyor.harness import ProcessGroup, RedisServer, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
IMAGE = (224, 224, 3)
COMMAND = "python -m bench.redis_cost"
SCRIPTED = frozenset(
    name.lower() for lua in (ROOT / "batching" / "lua").glob("*.lua")
    for name in re.findall(r"redis\.p?call\('(\w+)'", lua.read_text()))
"""Commands the Lua scripts call: commandstats counts them apart and in the script's time."""


IMAGE_MEAN_MODEL = """\
import numpy as np

PIXELS = 224 * 224


class Model:
    \"\"\"UINT8 images [n, 224, 224, 3] -> their channel means [n, 3] (FP32).\"\"\"

    def __init__(self, config: dict, device: str) -> None:
        pass

    def predict(self, inputs: dict) -> dict:
        x = inputs["INPUT0"]
        n = x.shape[0]
        # rows of 256 pixels summed down the image, then the 256 pixels' channels: both
        # sums run along contiguous memory (a sum over the strided channel axis, or
        # onnxruntime's Cast and ReduceMean, cost 4-7 times as much a row)
        rows = x.reshape(n, 196, 768).sum(axis=1, dtype=np.uint32)
        sums = rows.reshape(n, 256, 3).sum(axis=1)
        return {"OUTPUT0": (sums / PIXELS).astype(np.float32)}
"""
IMAGE_MEAN_CONFIG = """\
backend: python
max_batch_size: 64
inputs:
  - {name: INPUT0, datatype: UINT8, shape: [-1, 224, 224, 3]}
outputs:
  - {name: OUTPUT0, datatype: FP32, shape: [-1, 3]}
"""


def write_repository(root: Path) -> dict[str, Input]:
    """The two models' folders under ``root``; each model's one-row request tensor.
    ``image_mean`` is a Python model (numpy, about 35-60 µs a row on a 2-core virtual
    machine): cheap beside the request's path, which is what is measured."""
    export_onnx("mlp_tiny", root / "mlp_tiny" / "model.onnx")
    (root / "image_mean").mkdir(parents=True, exist_ok=True)
    (root / "image_mean" / "model.py").write_text(IMAGE_MEAN_MODEL)
    (root / "image_mean" / "config.yaml").write_text(IMAGE_MEAN_CONFIG)
    rng = np.random.default_rng(0)
    return {"mlp_tiny": Input("INPUT0", "FP32", rng.standard_normal((1, 64), np.float32)),
            "image_mean": Input("INPUT0", "UINT8",
                                rng.integers(0, 256, (1, *IMAGE), dtype=np.uint8))}


@dataclass(frozen=True)
class Cost:
    model: str
    path: str
    """how the input reached the inference process: ``redis`` or ``fetch``"""
    request_bytes: int
    io_threads: int
    requests: int
    rate: float
    """requests answered a second"""
    commands: dict[str, float]
    """calls per request, by command"""
    bytes_in: float
    bytes_out: float
    cpu_us: float
    main_us: float
    """the main thread's share of ``cpu_us``"""
    exec_us: float
    """the time of the commands themselves"""
    threaded: float
    """reads and writes done by I/O threads, per request"""


def snapshot(client: redis.Redis) -> tuple[float, float, int, int, int]:
    info = client.info()
    return (float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
            float(info["used_cpu_sys_main_thread"]) + float(info["used_cpu_user_main_thread"]),
            int(info["total_net_input_bytes"]), int(info["total_net_output_bytes"]),
            int(info["io_threaded_reads_processed"]) + int(info["io_threaded_writes_processed"]))


def measure(model: str, tensor: Input, io_threads: int, path: str, args: argparse.Namespace,
            work: Path) -> Cost:
    """One stack serving ``model``, its large inputs sent by ``path``; the Redis counters
    over a measured wrk run."""
    api_port = free_port()
    url = f"http://127.0.0.1:{api_port}"
    with ExitStack() as stack:
        threads = ["--io-threads", str(io_threads), "--io-threads-do-reads", "yes"]
        server = stack.enter_context(RedisServer(work, *(threads if io_threads > 1 else [])))
        env = {**os.environ, "CONVEYOR_REDIS_URL": server.url, "CONVEYOR_MODELS": model,
               "CONVEYOR_MODEL_REPOSITORY": str(work / "repo"), "CONVEYOR_API_WORKERS": "1",
               "CONVEYOR_HTTP_PORT": str(api_port), "CONVEYOR_GRPC_PORT": str(free_port()),
               "CONVEYOR_WORKER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1",
               # as between hosts: on one host a 150 KB input would take the tensor arena
               "CONVEYOR_TENSOR_TRANSPORT": path}
        stack.enter_context(running([
            ProcessGroup("api", [sys.executable, "-m", "api.serve"], env, work / "api.log", cwd=ROOT),
            ProcessGroup("worker", [sys.executable, "-m", "celery", "-A", "workers.app", "worker",
                                    "-n", f"cost-{api_port}@%h", "--loglevel", "WARNING",
                                    "--without-mingle", "--without-gossip"], env,
                         work / "worker.log", cwd=ROOT)], f"{url}/v2/health/ready"))
        body = binary_body([tensor])
        target = f"{url}/v2/models/{model}/infer"
        run_wrk(target, body, args.concurrency, args.warmup, work)
        client = redis.Redis.from_url(server.url)
        try:
            client.config_resetstat()
            cpu0, main0, in0, out0, threaded0 = snapshot(client)
            result = run_wrk(target, body, args.concurrency, args.duration, work)
            cpu1, main1, in1, out1, threaded1 = snapshot(client)
            stats = client.info("commandstats")
        finally:
            client.close()
    if result.errors:
        raise RuntimeError(f"{model}: {result.errors} requests failed")
    n = result.requests
    for own in ("cmdstat_info", "cmdstat_config|resetstat"):  # the measurement's own
        stats.pop(own, None)
    commands = {name.removeprefix("cmdstat_"): int(v["calls"]) / n for name, v in stats.items()}
    # A large entry through Redis is appended by a plain XADD of the API's (api/admission.py)
    direct = {"xadd"} if path == "redis" and len(body.content) > LARGE_ENTRY_BYTES else set()
    sent_us = sum(int(v["usec"]) for name, v in stats.items()
                  if name.removeprefix("cmdstat_") not in SCRIPTED - direct)
    return Cost(model, path, len(body.content), io_threads, n, result.throughput,
                dict(sorted(commands.items(), key=lambda kv: -kv[1])), (in1 - in0) / n,
                (out1 - out0) / n, (cpu1 - cpu0) * 1e6 / n, (main1 - main0) * 1e6 / n, sent_us / n,
                (threaded1 - threaded0) / n)


@contextmanager
def running(groups: list[ProcessGroup], ready_url: str) -> Iterator[None]:
    def ready() -> bool:
        try:
            with urllib.request.urlopen(ready_url, timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False
    try:
        wait_until(ready, 120, "conveyor to be ready", interval=0.2, watch=groups)
        yield
    finally:
        for group in reversed(groups):
            group.stop(20)


def report(costs: list[Cost], args: argparse.Namespace, started: datetime, load: float) -> str:
    lines = [
        "# What one request costs Redis", "",
        f"- date: {started:%Y-%m-%d %H:%M} UTC; machine: {os.cpu_count()} CPUs, load average "
        f"{load:.1f} at the start (other work on the machine inflates the CPU figures); Redis "
        f"{redis_version()}",
        f"- command: `{' '.join([COMMAND, *sys.argv[1:]])}`",
        f"- load: wrk, binary tensor extension, one row per request, c={args.concurrency}, "
        f"{args.duration}s after {args.warmup}s of warm-up; one API process, one inference "
        "process, conveyor's defaults",
        "- per request: Redis's own counters over the run divided by the requests answered; "
        "bytes in/out are what Redis read from and wrote to all its clients; CPU is the "
        "server's user+system time, all threads, and the main thread's part of it; executing "
        "is the commands' own time (`INFO commandstats`: the commands sent, a script with what "
        "it calls), the rest of the main thread's time is reading, parsing and writing; "
        "threaded I/O: the reads and writes the I/O threads took",
        "- one-core bound: 1 s / main-thread CPU per request, the rate at which Redis's main "
        "thread, which runs every command, would be busy all the time",
        "- inputs: how the input reached the inference process: `redis`, in the stream entry; "
        "`fetch`, from the API process's bytes endpoint (`CONVEYOR_TENSOR_TRANSPORT=fetch`, "
        "the path between hosts, here on one)", "",
        "| model | inputs | request bytes | io-threads | requests | req/s | commands / request | "
        "bytes in / request | bytes out / request | Redis CPU µs / request | main thread µs | "
        "executing µs | threaded I/O / request | one-core bound, req/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in costs:
        detail = ", ".join(f"{name} {calls:.2f}" for name, calls in c.commands.items() if calls >= 0.01)
        lines.append(f"| {c.model} | {c.path} | {c.request_bytes:,} | {c.io_threads} | "
                     f"{c.requests:,} | {c.rate:,.0f} | "
                     f"{sum(c.commands.values()):.2f} ({detail}) | {c.bytes_in:,.0f} | "
                     f"{c.bytes_out:,.0f} | {c.cpu_us:.1f} | {c.main_us:.1f} | {c.exec_us:.1f} | "
                     f"{c.threaded:.2f} | {1e6 / c.main_us:,.0f} |")
    return "\n".join(lines) + "\n"


def redis_version() -> str:
    out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("v=")), "?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--io-threads", type=int, nargs="+", default=[1],
                        help="Redis io-threads to measure with (above 1: reads threaded too)")
    parser.add_argument("--paths", nargs="+", choices=("redis", "fetch"),
                        default=["redis", "fetch"],
                        help="the ways image_mean's input is sent (mlp_tiny's: Redis)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS-redis.md")
    args = parser.parse_args()
    started, load = datetime.now(UTC), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="conveyor-redis-cost-") as tmp:
        work = Path(tmp)
        tensors = write_repository(work / "repo")
        costs = []
        for model, tensor in tensors.items():
            for path in args.paths if model == "image_mean" else ["redis"]:
                for io_threads in args.io_threads:
                    costs.append(measure(model, tensor, io_threads, path, args, work))
                    time.sleep(1)
    args.out.write_text(report(costs, args, started, load))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
