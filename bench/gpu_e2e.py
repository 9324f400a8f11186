"""The GPU benchmark's end-to-end phase: one request of each protocol compared with the raw
model's logits, then KServe v2 binary-tensor requests at each concurrency, from wrk (a C
load generator, closed loop: one request in flight per connection) or, with ``--load
python``, from several Python client processes (bench/gpu_load.py), and one JSON point,
each point recorded with the batches the worker ran, the processes' CPU time (the load
generator's too), and the GPU's utilisation meanwhile. Then the same binary load against
the plain FastAPI wrapper (bench/gpu_plain.py) on the same GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from bench.gpu_load import GpuSampler, client_run
from bench.gpu_models import BENCH_MODEL, binary_request, json_request, relative_diff, seeded_images
from bench.gpu_raw import pct
from bench.gpu_record import Phases, Recorder
from bench.gpu_stack import ROOT, GpuStack, infer_logits
from conveyor.bench_load import run_wrk
from conveyor.bench_request import Body
from conveyor.harness import ProcessGroup, free_port, group_cpu_s, wait_until


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
        if self.args.load != "python":
            return
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

    def run(self, reference: Any, many: list[Any]) -> None:
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
        if many:
            self.batched_correctness(many)
        if args.profile_s > 0:
            self.profile(max(args.concurrency), body, headers)
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

    def batched_correctness(self, many: list[Any]) -> None:
        """Distinct images sent all at once (so batched together, stacked in the model's
        pinned buffer on a GPU): each answer against that image's own logits."""
        from concurrent.futures import ThreadPoolExecutor

        from bench.gpu_models import tolerance

        def one(i: int) -> float:
            got = infer_logits(self.stack.base, BENCH_MODEL, seeded_images(1, seed=100 + i), "binary")
            return relative_diff(got, many[i])

        with ThreadPoolExecutor(len(many)) as pool:
            diffs = list(pool.map(one, range(len(many))))
        stats = self.stack.stats(BENCH_MODEL)
        self.rec.emit("e2e_batched_correctness", requests=len(many),
                      worst_relative_diff=round(max(diffs), 5),
                      all_within_tolerance=max(diffs) <= tolerance(self.args.device),
                      largest_batch=max((int(k.split(":")[1]) for k in stats
                                         if k.startswith("batch:") and k.endswith(":count")),
                                        default=0))

    def _clients(self, concurrency: int, body: bytes, headers: dict[str, str],
                 seconds: float, base: str | None = None) -> list[dict[str, Any]]:
        """``concurrency`` request loops for ``seconds``: wrk's connections, or spread over
        the Python client processes."""
        url = f"{base or self.stack.base}/v2/models/{BENCH_MODEL}/infer"
        if self.args.load == "wrk":
            return [wrk_run(url, body, headers, concurrency, seconds, self.args.wrk_threads)]
        assert self.pool is not None
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
        ok, rate, p50, p99 = summary(results)
        elapsed = max(r["elapsed_s"] for r in results)
        d = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in stats1}
        sizes = {int(k.split(":")[1]): v for k, v in d.items()
                 if k.startswith("batch:") and k.endswith(":count") and v > 0}
        rows = sum(n * c for n, c in sizes.items())
        batch_ns = {int(k.split(":")[1]): v for k, v in d.items()
                    if k.startswith("batch:") and k.endswith(":ns") and v > 0}
        cpu = {k: round(cpu1.get(k, 0) - cpu0.get(k, 0), 2) for k in cpu1}
        cpu["client"] = round(sum(r.get("client_cpu_s", 0.0) for r in results), 2)
        self.rec.emit(
            "e2e", protocol=label, concurrency=concurrency, client_procs=len(results),
            client=results[0]["client"], duration_s=round(elapsed, 2),
            ok=ok, errors=sum(r["errors"] for r in results),
            error_samples=[s for r in results for s in r["error_samples"]][:3],
            req_per_s=round(rate, 1), p50_ms=p50, p99_ms=p99,
            # where a request's time goes: CPU µs per request of each process group, and
            # the model's own time on the device per request (the batch's, shared)
            us_per_request={k: round(v * 1e6 / ok) for k, v in cpu.items()} if ok else None,
            compute_us_per_request=round(sum(batch_ns.values()) / 1e3 / ok) if ok else None,
            batches=d.get("execution_count", 0),
            mean_batch=round(d.get("inference_count", 0) / d["execution_count"], 2)
            if d.get("execution_count") else None,
            mean_batch_per_request=round(sum(n * n * c for n, c in sizes.items()) / rows, 2)
            if rows else None,
            batch_exec_ms={str(n): round(batch_ns[n] / sizes[n] / 1e6, 2)
                           for n in sorted(sizes) if n in batch_ns and sizes[n] >= 3},
            batch_sizes={str(n): sizes[n] for n in sorted(sizes)},
            cpu_s=cpu, gpu_util=util.summary())

    def load_point_warm(self, concurrency: int, body: bytes, headers: dict[str, str],
                        seconds: float) -> None:
        started = time.monotonic()
        results = self._clients(concurrency, body, headers, seconds)
        self.rec.emit("e2e_warmup", concurrency=concurrency, seconds=round(time.monotonic() - started, 1),
                      ok=summary(results)[0],
                      errors=sum(r["errors"] for r in results),
                      error_samples=[s for r in results for s in r["error_samples"]][:3])


    def profile(self, concurrency: int, body: bytes, headers: dict[str, str]) -> None:
        """py-spy on the API and the worker (their children too) under the load of
        ``concurrency``, as collapsed stacks in OUT/pyspy-{group}.txt, where it is installed."""
        import shutil
        import subprocess

        spy = shutil.which("py-spy")
        if spy is None:
            self.rec.emit("profile", skipped="py-spy is not installed")
            return
        seconds = self.args.profile_s
        spies = [subprocess.Popen([spy, "record", "--subprocesses", "--nonblocking",
                                   "--format", "raw", "-r", "200", "-d", str(round(seconds)),
                                   "-p", str(self.stack.groups[g].pid),
                                   "-o", str(self.args.out / f"pyspy-{g}.txt")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for g in ("api", "worker")]
        results = self._clients(concurrency, body, headers, seconds + 1)
        errors = [s.communicate(timeout=30)[1].decode(errors="replace")[-300:] for s in spies]
        self.rec.emit("profile", concurrency=concurrency, seconds=seconds,
                      req_per_s=round(summary(results)[1], 1),
                      exit_codes=[s.returncode for s in spies], stderr_tails=errors)

    def plain(self, model_pt: Path) -> None:
        """The binary load against the plain FastAPI wrapper on the same device."""
        args = self.args
        port = free_port()
        env = {**os.environ, "GPU_PLAIN_MODEL": str(model_pt), "GPU_PLAIN_DEVICE": args.device,
               "GPU_PLAIN_NAME": BENCH_MODEL}
        group = ProcessGroup("plain", [sys.executable, "-m", "uvicorn", "bench.gpu_plain:app",
                                       "--port", str(port), "--no-access-log",
                                       "--log-level", "warning"],
                             env, self.stack.logdir / "plain.log", cwd=ROOT)
        base = f"http://127.0.0.1:{port}"
        body, headers = binary_request(seeded_images(1, seed=7))
        try:
            wait_until(lambda: _answers(f"{base}/v2/models/{BENCH_MODEL}/infer", body, headers),
                       60, "the plain wrapper to answer", interval=0.5, watch=[group])
            for c in args.plain_concurrency:
                if self.phases.left() < args.duration + args.warmup + 15:
                    self.rec.emit("plain", concurrency=c, skipped="budget")
                    continue
                self._clients(c, body, headers, args.warmup, base)
                cpu0 = group_cpu_s([group])
                util = GpuSampler(args.device)
                util.start()
                results = self._clients(c, body, headers, args.duration, base)
                util.stop()
                cpu1 = group_cpu_s([group])
                ok, rate, p50, p99 = summary(results)
                self.rec.emit("plain", concurrency=c, ok=ok, errors=sum(r["errors"] for r in results),
                              req_per_s=round(rate, 1), p50_ms=p50, p99_ms=p99,
                              cpu_s={"plain": round(cpu1.get("plain", 0) - cpu0.get("plain", 0), 2),
                                     "client": round(sum(r.get("client_cpu_s", 0.0)
                                                         for r in results), 2)},
                              gpu_util=util.summary())
        finally:
            group.stop()


def summary(results: list[dict[str, Any]]) -> tuple[int, float, float | None, float | None]:
    """Answers, answers a second, p50 and p99 (ms) of one point's client results: wrk's
    report, or the Python clients' latencies."""
    if "latencies" not in results[0]:
        only = results[0]
        return only["ok"], only["req_per_s"], only["p50_ms"], only["p99_ms"]
    latencies = [v for r in results for v in r["latencies"]]
    elapsed = max(r["elapsed_s"] for r in results)
    if not latencies:
        return 0, 0.0, None, None
    return (len(latencies), len(latencies) / elapsed, round(statistics.median(latencies), 2),
            round(pct(latencies, 0.99), 2))


def wrk_run(url: str, body: bytes, headers: dict[str, str], concurrency: int, seconds: float,
            threads: int) -> dict[str, Any]:
    """One closed-loop wrk run; its own CPU time is the children's rusage it adds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-wrk-") as tmp:
        result = run_wrk(url, Body(body, headers), concurrency, max(1, round(seconds)), Path(tmp),
                         threads=min(threads, concurrency))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"ok": result.requests - result.errors, "errors": result.errors, "error_samples": [],
            "req_per_s": result.throughput * (result.requests - result.errors) / max(1, result.requests),
            "p50_ms": result.p50_ms, "p99_ms": result.p99_ms,
            "elapsed_s": time.perf_counter() - started, "client": f"wrk -t{min(threads, concurrency)}",
            "client_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)}


def _answers(url: str, body: bytes, headers: dict[str, str]) -> bool:
    with contextlib.suppress(OSError):
        request = urllib.request.Request(url, body, headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status) == 200
    return False


def _noop(_: int) -> None:
    return None
