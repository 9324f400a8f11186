"""The GPU benchmark's end-to-end phase: one request of each protocol compared with the raw
model's logits, then KServe v2 binary-tensor requests from several client processes
(bench/gpu_load.py) at each concurrency and one JSON point, each point recorded with the
batches the worker ran, the processes' CPU time and the GPU's utilisation meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from bench.gpu_load import GpuSampler, client_run
from bench.gpu_models import BENCH_MODEL, binary_request, json_request, relative_diff, seeded_images
from bench.gpu_raw import pct
from bench.gpu_record import Phases, Recorder
from bench.gpu_stack import GpuStack, infer_logits
from conveyor.harness import group_cpu_s


class EndToEnd:
    """The client processes (spawned once the stack is up, so that their start-up is not
    timed) and the load points they drive against ``stack``."""

    def __init__(self, rec: Recorder, args: argparse.Namespace, stack: GpuStack, phases: Phases) -> None:
        self.rec = rec
        self.args = args
        self.stack = stack
        self.phases = phases
        self.pool: ProcessPoolExecutor | None = None

    def start_clients(self) -> None:
        clients = self.args.clients
        self.pool = ProcessPoolExecutor(max_workers=clients, mp_context=get_context("spawn"))
        list(self.pool.map(_noop, range(clients)))  # start them now

    def stop_clients(self) -> None:
        if self.pool is not None:
            procs = list((getattr(self.pool, "_processes", None) or {}).values())
            self.pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                with contextlib.suppress(Exception):
                    proc.kill()

    def run(self, reference: Any) -> None:
        self.correctness(reference)
        args = self.args
        body, headers = binary_request(seeded_images(1, seed=7))
        # Warm the TorchScript executor up on many batch sizes before the first point.
        self.load_point_warm(max(args.concurrency), body, headers, args.first_warmup)
        for c in args.concurrency:
            if self.phases.left() < args.duration + args.warmup + 60:
                self.rec.emit("e2e", protocol="binary", concurrency=c, skipped="budget")
                continue
            self.load_point("binary", c, body, headers, args.duration, args.warmup)
        if args.json_concurrency and self.phases.left() > args.json_duration + 60:
            jbody, jheaders = json_request(seeded_images(1, seed=7))
            self.load_point("json", args.json_concurrency, jbody, jheaders, args.json_duration,
                            args.warmup)
        with urllib.request.urlopen(f"{self.stack.base}/metrics", timeout=5) as response:
            metrics = response.read().decode(errors="replace")
        self.rec.emit("metrics_sample", note="one API process's registry (of --workers N)",
                      lines=[ln for ln in metrics.splitlines()
                             if ln.startswith(("conveyor_request_batch_size_sum",
                                               "conveyor_request_batch_size_count",
                                               "conveyor_requests_total", "conveyor_oom"))
                             and f'model="{BENCH_MODEL}"' in ln])

    def correctness(self, reference: Any) -> None:
        """One binary and one JSON request of the reference image, against the raw logits."""
        results = {}
        for protocol in ("binary", "json"):
            got = infer_logits(self.stack.base, BENCH_MODEL, seeded_images(1), protocol)
            results[protocol] = {
                "shape": list(got.shape),
                "max_abs_diff_vs_raw": float(abs(got - reference).max()),
                "relative_diff_vs_raw": relative_diff(got, reference),
                "same_argmax": bool(got.argmax() == reference.argmax()),
                "reference_absmax": float(abs(reference).max())}
        self.rec.emit("e2e_correctness", **results)

    def _clients(self, concurrency: int, body: bytes, headers: dict[str, str],
                 seconds: float) -> list[dict[str, Any]]:
        """``concurrency`` request loops for ``seconds``, spread over the client processes."""
        assert self.pool is not None
        url = f"{self.stack.base}/v2/models/{BENCH_MODEL}/infer"
        procs = min(self.args.clients, concurrency)
        split = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
        return list(self.pool.map(client_run, [url] * procs, [body] * procs, [headers] * procs,
                                  split, [seconds] * procs))

    def load_point(self, label: str, concurrency: int, body: bytes, headers: dict[str, str],
                   duration_s: float, warmup_s: float) -> None:
        if warmup_s > 0:
            self._clients(concurrency, body, headers, warmup_s)
        groups = list(self.stack.groups.values())
        stats0 = self.stack.stats(BENCH_MODEL)
        cpu0 = group_cpu_s(groups)
        util = GpuSampler(self.args.device)
        util.start()
        results = self._clients(concurrency, body, headers, duration_s)
        util.stop()
        cpu1 = group_cpu_s(groups)
        stats1 = self.stack.stats(BENCH_MODEL)
        latencies = [v for r in results for v in r["latencies"]]
        elapsed = max(r["elapsed_s"] for r in results)
        d = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in stats1}
        sizes = {int(k.split(":")[1]): v for k, v in d.items()
                 if k.startswith("batch:") and k.endswith(":count") and v > 0}
        rows = sum(n * c for n, c in sizes.items())
        batch_ns = {int(k.split(":")[1]): v for k, v in d.items()
                    if k.startswith("batch:") and k.endswith(":ns") and v > 0}
        self.rec.emit(
            "e2e", protocol=label, concurrency=concurrency, client_procs=len(results),
            client=results[0]["client"], duration_s=round(elapsed, 2),
            ok=len(latencies), errors=sum(r["errors"] for r in results),
            error_samples=[s for r in results for s in r["error_samples"]][:3],
            req_per_s=round(len(latencies) / elapsed, 1),
            p50_ms=round(statistics.median(latencies), 2) if latencies else None,
            p99_ms=round(pct(latencies, 0.99), 2) if latencies else None,
            batches=d.get("execution_count", 0),
            mean_batch=round(d.get("inference_count", 0) / d["execution_count"], 2)
            if d.get("execution_count") else None,
            mean_batch_per_request=round(sum(n * n * c for n, c in sizes.items()) / rows, 2)
            if rows else None,
            batch_exec_ms={str(n): round(batch_ns[n] / sizes[n] / 1e6, 2)
                           for n in sorted(sizes) if n in batch_ns and sizes[n] >= 3},
            batch_sizes={str(n): sizes[n] for n in sorted(sizes)},
            cpu_s={k: round(cpu1.get(k, 0) - cpu0.get(k, 0), 1) for k in cpu1},
            gpu_util=util.summary())

    def load_point_warm(self, concurrency: int, body: bytes, headers: dict[str, str],
                        seconds: float) -> None:
        started = time.monotonic()
        results = self._clients(concurrency, body, headers, seconds)
        self.rec.emit("e2e_warmup", concurrency=concurrency, seconds=round(time.monotonic() - started, 1),
                      ok=sum(len(r["latencies"]) for r in results),
                      errors=sum(r["errors"] for r in results),
                      error_samples=[s for r in results for s in r["error_samples"]][:3])


def _noop(_: int) -> None:
    return None
