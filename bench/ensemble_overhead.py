"""What an ensemble costs against the client calling its steps itself, in one run.

Usage: python -m bench.ensemble_overhead [--concurrency 64] [--duration 8] [--rounds 2]

Serves two cheap Python models (``first``: y = x + 1, ``second``: y = 2 x, FP32 [16]) and
``chain``, a Triton ensemble of the two (config.pbtxt), through conveyor (one API process,
a Celery worker, an own redis-server). ``--concurrency`` clients (asyncio, aiohttp, KServe
JSON, one row) run in turn, ``--rounds`` times each: ``ensemble`` sends one request to
``chain``; ``client chain`` sends ``first`` and then ``second`` with the first's output.
A pipeline answered counts once either way; the ratio is ensemble / client chain.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from conveyor.harness import ProcessGroup, RedisServer, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python -m bench.ensemble_overhead"
STEP = """backend: python
max_batch_size: 64
inputs: [{{name: x, datatype: FP32, shape: [-1, 16]}}]
outputs: [{{name: y, datatype: FP32, shape: [-1, 16]}}]
"""
MODEL = """import numpy as np


class Model:
    def __init__(self, config, device):
        pass

    def predict(self, inputs):
        return {{"y": {expression}}}
"""
CHAIN = """name: "chain"
platform: "ensemble"
max_batch_size: 64
input [ { name: "x" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 16 ] } ]
ensemble_scheduling { step [
  { model_name: "first" model_version: -1 input_map { key: "x" value: "x" }
    output_map { key: "y" value: "mid" } },
  { model_name: "second" model_version: -1 input_map { key: "x" value: "mid" }
    output_map { key: "y" value: "y" } }
] }
"""


def repository(root: Path) -> Path:
    for name, expression in (("first", 'inputs["x"] + 1'), ("second", 'inputs["x"] * 2')):
        (root / name).mkdir(parents=True)
        (root / name / "config.yaml").write_text(STEP.format())
        (root / name / "model.py").write_text(MODEL.format(expression=expression))
    (root / "chain").mkdir()
    (root / "chain" / "config.pbtxt").write_text(CHAIN)
    return root


def body(data: list[float]) -> bytes:
    return orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16],
                                     "data": data}]})


async def infer(session: aiohttp.ClientSession, url: str, data: list[float]) -> list[float]:
    async with session.post(url, data=body(data),
                            headers={"content-type": "application/json"}) as answer:
        if answer.status != 200:
            raise RuntimeError(f"{url}: {answer.status} {await answer.text()}")
        found: list[float] = orjson.loads(await answer.read())["outputs"][0]["data"]
        return found


async def load(base: str, mode: str, concurrency: int, duration: float) -> tuple[int, list[float]]:
    """Pipelines answered and their latencies (s) over ``duration``."""
    data = [float(i) for i in range(16)]
    expected = [(v + 1) * 2 for v in data]
    latencies: list[float] = []
    stop = time.perf_counter() + duration

    async def client(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            if mode == "ensemble":
                out = await infer(session, f"{base}/v2/models/chain/infer", data)
            else:
                mid = await infer(session, f"{base}/v2/models/first/infer", data)
                out = await infer(session, f"{base}/v2/models/second/infer", mid)
            if out != expected:
                raise RuntimeError(f"{mode}: wrong answer {out}")
            latencies.append(time.perf_counter() - started)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return len(latencies), latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        work = Path(scratch)
        server = stack.enter_context(RedisServer(work))
        port = free_port()
        env = {**os.environ, "CONVEYOR_REDIS_URL": server.url, "CONVEYOR_API_WORKERS": "1",
               "CONVEYOR_MODEL_REPOSITORY": str(repository(work / "repo")),
               "CONVEYOR_HTTP_PORT": str(port), "CONVEYOR_GRPC_PORT": str(free_port()),
               "CONVEYOR_WORKER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
        groups = [ProcessGroup("api", [sys.executable, "-m", "api.serve"], env,
                               work / "api.log", cwd=ROOT),
                  ProcessGroup("worker", [sys.executable, "-m", "celery", "-A", "workers.app",
                                          "worker", "-n", f"ensemble-{port}@%h", "--loglevel",
                                          "WARNING", "--without-mingle", "--without-gossip"],
                               env, work / "worker.log", cwd=ROOT)]
        for group in reversed(groups):
            stack.callback(group.stop, 20)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: ready(base), 120, "conveyor to be ready", interval=0.2, watch=groups)
        asyncio.run(load(base, "ensemble", args.concurrency, 2.0))  # warm-up
        asyncio.run(load(base, "client chain", args.concurrency, 2.0))
        results: dict[str, list[tuple[int, list[float]]]] = {"ensemble": [], "client chain": []}
        for _ in range(args.rounds):
            for mode, runs in results.items():
                runs.append(asyncio.run(load(base, mode, args.concurrency, args.duration)))
    print(f"c={args.concurrency}, {args.duration:g} s a run, {args.rounds} runs each, "
          "alternated; load average at the end: "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}\n")
    print("| path | pipelines/s (each run) | p50 ms | p99 ms |")
    print("|---|---|---|---|")
    rates: dict[str, float] = {}
    for mode, runs in results.items():
        each = [n / args.duration for n, _ in runs]
        every = [t for _, times in runs for t in times]
        rates[mode] = sum(each) / len(each)
        print(f"| {mode} | {' / '.join(f'{r:,.0f}' for r in each)} | "
              f"{percentile(every, 0.5) * 1e3:.1f} | {percentile(every, 0.99) * 1e3:.1f} |")
    print(f"\nratio ensemble / client chain: {rates['ensemble'] / rates['client chain']:.2f}x")


def ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=2) as answer:
            status: Any = answer.status
            return bool(status == 200)
    except OSError:
        return False


if __name__ == "__main__":
    main()
