"""Closed-loop load over gRPC or HTTP with binary tensors, through the official tritonclient.

wrk drives the JSON rows of the benchmark; wrk cannot speak gRPC, and a binary body is
built per request by the client. This does what wrk does for those two: ``connections``
clients each send the next request as soon as the last one is answered, for
``duration_s`` seconds, and the summary has the same keys as ``bench.wrk.run_wrk``'s.

The client is Python, so one process tops out at a few thousand requests per second;
``processes`` spreads the connections over several processes (and cores) and adds the
results up. Report its CPU beside the server's, as for wrk.

    python -m bench.grpc_load --protocol grpc --url 127.0.0.1:8001 --model mlp_tiny \\
        --input INPUT0 --width 64 -c 64 -d 10 --processes 2
    python -m bench.grpc_load --protocol http-binary --url 127.0.0.1:8000 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from typing import Any

import numpy as np

from bench.wrk import WrkResult

PROTOCOLS = ("grpc", "http-binary")


async def _client_loop(protocol: str, url: str, model: str, input_name: str, width: int,
                       rows: int, stop_at: float, latencies: list[float]) -> int:
    """One connection: infer until ``stop_at``; return the number of failed requests."""
    data = np.random.default_rng(len(latencies)).random((rows, width), dtype=np.float32)
    if protocol == "grpc":
        import tritonclient.grpc.aio as client_module
    else:
        import tritonclient.http.aio as client_module
    client = client_module.InferenceServerClient(url)
    item = client_module.InferInput(input_name, [rows, width], "FP32")
    item.set_data_from_numpy(data)
    errors = 0
    try:
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            try:
                await client.infer(model, [item])
            except Exception:  # any failure counts as an error, as wrk counts them
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)
    finally:
        await client.close()
    return errors


async def _run(protocol: str, url: str, model: str, input_name: str, width: int, rows: int,
               connections: int, duration_s: float) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    started = time.monotonic()
    stop_at = started + duration_s
    errors = await asyncio.gather(*[
        _client_loop(protocol, url, model, input_name, width, rows, stop_at, latencies)
        for _ in range(connections)])
    return latencies, sum(errors), time.monotonic() - started


def _worker(args: tuple[Any, ...]) -> tuple[list[float], int, float]:
    return asyncio.run(_run(*args))


def run_load(protocol: str, url: str, model: str, input_name: str, width: int,
             connections: int = 1, duration_s: float = 10.0, rows: int = 1,
             processes: int = 1) -> WrkResult:
    """Drive ``model`` for ``duration_s`` with ``connections`` closed-loop clients."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}")
    processes = max(1, min(processes, connections))
    shares = [connections // processes + (i < connections % processes) for i in range(processes)]
    jobs = [(protocol, url, model, input_name, width, rows, share, duration_s) for share in shares]
    if processes == 1:
        parts = [_worker(jobs[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            parts = pool.map(_worker, jobs)
    latencies = np.array([value for part in parts for value in part[0]])
    elapsed = max(part[2] for part in parts)
    done = len(latencies)
    return WrkResult(
        rps=done / elapsed if elapsed else 0.0,
        p50_ms=float(np.percentile(latencies, 50) * 1000) if done else 0.0,
        p99_ms=float(np.percentile(latencies, 99) * 1000) if done else 0.0,
        errors=sum(part[1] for part in parts),
        requests=done,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", choices=PROTOCOLS, default="grpc")
    parser.add_argument("--url", required=True, help="host:port (gRPC 8001, HTTP 8000)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--input", default="INPUT0", help="the model's FP32 input")
    parser.add_argument("--width", type=int, required=True, help="the input's second dim")
    parser.add_argument("--rows", type=int, default=1, help="rows per request")
    parser.add_argument("-c", "--connections", type=int, default=1)
    parser.add_argument("-d", "--duration", type=float, default=10.0, help="seconds")
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(run_load(args.protocol, args.url, args.model, args.input, args.width,
                              args.connections, args.duration, args.rows, args.processes)))


if __name__ == "__main__":
    main()
