"""GPU benchmark: the raw ResNet-50 ceiling and conveyor end to end on the GPU, and what a
real CUDA out-of-memory error does under load. The correctness checks are the GPU tests
(tests/gpu/, ``make test-gpu``); the figures are here.

Usage: bash bench/gpu_bench.sh                      (on the GPU machine: sets up redis-server
                                                     and the wheels first, see that file)
       python -m bench.gpu_bench --device cpu --quick   (a dry run of every step on a CPU)

Phases, each time-boxed, each failure recorded and the next phase run anyway:

1. env:  torch, the device, package versions.
2. raw:  ResNet-50 (torchvision, weights=None, seeded, eval) behind a wrapper that takes
         uint8 NHWC images and normalises on the device; FP16 + channels_last on CUDA
         (bench/gpu_models.py). Batch-1 latency and rows/s at several batch sizes, eager and
         TorchScript (traced), with the input already on the device; then conveyor's own
         backend (load_model + predict: numpy in, copies both ways, numpy out), i.e. the
         inference process without the serving stack.
3. e2e:  a model repository (resnet50: the traced wrapper, torchscript backend; oomtest:
         a python model), redis-server, the API (uvicorn --workers N) and a Celery worker
         (bench/gpu_stack.py); one request of each protocol compared with the raw model's
         logits, then KServe v2 binary-tensor requests from several client processes at each
         concurrency (and one JSON point).
4. oom:  waves of concurrent requests to ``oomtest``, whose predict allocates on the device
         in proportion to its rows so that more than --oom-rows rows cannot fit: whether
         every request succeeded, the learned row caps (heartbeat ``row_cap``) and
         ``oom_count`` of the stats hash.

Every record is one JSON line on stdout and in OUT/gpu.json; the report (--report: by default
bench/RESULTS-gpu.md on a CUDA device, OUT/gpu.md for a dry run) holds the tables, and
OUT/services.log the servers' log tails.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from bench.gpu_load import GpuSampler, client_run
from bench.gpu_models import (
    binary_request,
    export_repository,
    json_request,
    logits,
    relative_diff,
    resnet50,
    seeded_images,
    small_cnn,
)
from bench.gpu_stack import GpuStack, infer_logits, oom_waves
from conveyor.harness import group_cpu_s

ROOT = Path(__file__).resolve().parent.parent
MODEL = "resnet50"
NETS = {"resnet50": ("ResNet-50", resnet50), "small": ("small CNN", small_cnn)}
"""--net: the network behind the classifier wrapper (the small one for a quick dry run
where torchvision is not installed)."""


# --------------------------------------------------------------------------- records


class Recorder:
    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "gpu.json"
        self.path.write_text("")
        self.records: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def emit(self, kind: str, **data: Any) -> dict[str, Any]:
        record = {"kind": kind, "t": round(time.monotonic() - self.started, 1), **data}
        self.records.append(record)
        line = json.dumps(record, default=str)
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")
        return record

    def find(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == kind]


class PhaseTimeout(Exception):
    pass


def _alarm(_signum: int, _frame: object) -> None:
    raise PhaseTimeout("phase time box exceeded")


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(f"signal {signum}")


class Phases:
    """Runs each phase under a time box (SIGALRM) and an overall deadline; never raises."""

    def __init__(self, rec: Recorder, budget_s: float) -> None:
        self.rec = rec
        self.deadline = time.monotonic() + budget_s
        self.status: dict[str, str] = {}
        signal.signal(signal.SIGALRM, _alarm)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, limit_s: float, action: Callable[[], None],
            reserve_s: float = 20.0) -> bool:
        limit = min(limit_s, self.left() - reserve_s)
        if limit < 5:
            self.status[name] = "skipped (no time left)"
            self.rec.emit("phase", phase=name, ok=False, error="skipped: overall budget spent")
            return False
        started = time.monotonic()
        self.rec.emit("phase_start", phase=name, limit_s=round(limit))
        signal.alarm(max(1, int(limit)))
        try:
            action()
        except (Exception, PhaseTimeout) as exc:
            signal.alarm(0)
            self.status[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
            self.rec.emit("phase", phase=name, ok=False, seconds=round(time.monotonic() - started, 1),
                          error=f"{type(exc).__name__}: {exc}"[:2000],
                          traceback=traceback.format_exc()[-3000:])
            return False
        finally:
            signal.alarm(0)
        self.status.setdefault(name, "ok")
        self.rec.emit("phase", phase=name, ok=True, seconds=round(time.monotonic() - started, 1))
        return True


# --------------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_calls(call: Callable[[], Any], device: str, calls: int, warmup: int) -> dict[str, float]:
    """Per-call wall time (synchronised) of ``call``: p50, p99, mean, in ms."""
    for _ in range(warmup):
        call()
    _sync(device)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return {"p50_ms": round(statistics.median(times), 3), "p99_ms": round(_pct(times, 0.99), 3),
            "mean_ms": round(statistics.fmean(times), 3), "calls": calls}


def rows_per_s(call: Callable[[], Any], rows: int, device: str, seconds: float, warmup: int) -> float:
    """Rows/s running ``call`` back to back for ``seconds`` (synchronised at the ends)."""
    for _ in range(warmup):
        call()
    _sync(device)
    calls = 0
    start = time.perf_counter()
    while True:
        call()
        calls += 1
        if calls % 4 == 0 or rows >= 32:
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return calls * rows / elapsed


# --------------------------------------------------------------------------- the benchmark


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rec = Recorder(args.out)
        self.phases = Phases(self.rec, args.budget_s)
        self.work = Path(tempfile.mkdtemp(prefix="conveyor-gpu-"))
        self.reference: Any = None  # eager logits of seeded_images(1)
        self.stack = GpuStack(self.work / "repo", self.work / "logs", args.api_workers,
                              args.redis_server, args.redis_ld)
        self.pool: ProcessPoolExecutor | None = None

    # ----- phase 1
    def env_phase(self) -> None:
        import torch

        cudnn: Any = torch.backends.cudnn  # untyped
        info: dict[str, Any] = {
            "python": sys.version.split()[0], "executable": sys.executable,
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": cudnn.version() if cudnn.is_available() else None,
            "cudnn_benchmark": cudnn.benchmark,
            "device": self.args.device,
            "commit": _commit(),
        }
        if self.args.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise RuntimeError("torch.cuda.is_available() is False")
            props = torch.cuda.get_device_properties(self.args.device)
            info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                        gpu_memory_gib=round(props.total_memory / 2**30, 1),
                        multiprocessors=props.multi_processor_count)
            with contextlib.suppress(Exception):
                smi = subprocess.run(
                    ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                     "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
                info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        from importlib import metadata

        versions: dict[str, str | None] = {}
        for name in ("torchvision", "numpy", "fastapi", "starlette", "uvicorn", "httptools",
                     "uvloop", "pydantic", "pydantic-settings", "redis", "hiredis", "celery",
                     "kombu", "orjson", "msgpack", "grpcio", "protobuf", "aiohttp", "httpx"):
            try:
                versions[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                versions[name] = None
        info["packages"] = versions
        self.rec.emit("env", **info)

    # ----- phase 2
    def raw_phase(self) -> None:
        import torch

        args = self.args
        device = args.device
        exported = export_repository(self.stack.repo, device, NETS[args.net][1](), MODEL, args.max_batch,
                                     args.oom_rows)
        model, traced = exported.eager, exported.traced
        self.rec.emit("raw_model", dtype=str(model.mean.dtype), memory_format="channels_last",
                      params=sum(p.numel() for p in model.parameters()))
        self.rec.emit("repository", path=str(exported.repo),
                      model_pt_mib=round((exported.repo / MODEL / "model.pt").stat().st_size
                                         / 2**20, 1))
        one_image = seeded_images(1)
        self.reference = logits(model, one_image, device)
        self.rec.emit("raw_reference", finite=bool(torch.isfinite(torch.from_numpy(self.reference)).all()),
                      argmax=int(self.reference.argmax()),
                      logit_absmax=float(abs(self.reference).max()))
        one = torch.from_numpy(one_image).to(device)
        with torch.inference_mode():
            for variant, module in (("eager", model), ("torchscript", traced)):
                lat = time_calls(functools.partial(module, one), device, args.latency_calls, warmup=20)
                rates = {}
                for bs in args.raw_batches:
                    x = torch.from_numpy(seeded_images(bs, seed=bs)).to(device)
                    rates[str(bs)] = round(rows_per_s(functools.partial(module, x), bs, device,
                                                      args.raw_seconds, warmup=5))
                self.rec.emit("raw", variant=variant, input="on device", batch1=lat,
                              rows_per_s=rates)
        diff = float(abs(logits(traced, one_image, device) - self.reference).max())
        self.rec.emit("raw_trace_check", max_abs_diff_vs_eager=diff)
        del model, traced, exported
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        self._backend_raw()

    def _backend_raw(self) -> None:
        """conveyor's backend without the serving stack: numpy in, copies, numpy out."""
        import torch

        from batching.repository_scan import load_model_config
        from workers.backends import load_model

        args = self.args
        folder = self.stack.repo / MODEL
        loaded = load_model(load_model_config(folder), folder, args.device)
        one = {"image": seeded_images(1)}
        lat = time_calls(functools.partial(loaded.predict, one), "cpu", args.latency_calls, warmup=20)
        rates = {}
        for bs in [b for b in args.raw_batches if b <= args.max_batch]:
            batch = {"image": seeded_images(bs, seed=bs)}
            rates[str(bs)] = round(rows_per_s(functools.partial(loaded.predict, batch), bs, "cpu",
                                              args.raw_seconds, warmup=3))
        out = loaded.predict(one)["logits"]
        diff = float(abs(out - self.reference).max()) if self.reference is not None else None
        self.rec.emit("raw", variant="conveyor backend (torchscript, numpy in/out)",
                      input="numpy on host", batch1=lat, rows_per_s=rates,
                      max_abs_diff_vs_eager=diff)
        del loaded
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    # ----- phase 3
    def start_stack(self) -> None:
        args = self.args
        if not (self.stack.repo / MODEL / "model.pt").exists():
            raise RuntimeError("no model repository: the raw phase did not export the model")
        started = time.monotonic()
        self.stack.start(args.ready_timeout)
        self.rec.emit("stack_ready", seconds=round(time.monotonic() - started, 1),
                      api_workers=args.api_workers, workers=self.stack.heartbeats(MODEL))
        self.pool = ProcessPoolExecutor(max_workers=args.clients, mp_context=get_context("spawn"))
        list(self.pool.map(_noop, range(args.clients)))  # start them now

    def correctness(self) -> None:
        """One binary and one JSON request of the reference image, against the raw logits."""
        results = {}
        for protocol in ("binary", "json"):
            got = infer_logits(self.stack.base, MODEL, seeded_images(1), protocol)
            results[protocol] = {
                "shape": list(got.shape),
                "max_abs_diff_vs_raw": float(abs(got - self.reference).max()),
                "relative_diff_vs_raw": relative_diff(got, self.reference),
                "same_argmax": bool(got.argmax() == self.reference.argmax()),
                "reference_absmax": float(abs(self.reference).max())}
        self.rec.emit("e2e_correctness", **results)

    def _clients(self, concurrency: int, body: bytes, headers: dict[str, str],
                 seconds: float) -> list[dict[str, Any]]:
        """``concurrency`` request loops for ``seconds``, spread over the client processes."""
        assert self.pool is not None
        url = f"{self.stack.base}/v2/models/{MODEL}/infer"
        procs = min(self.args.clients, concurrency)
        split = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
        return list(self.pool.map(client_run, [url] * procs, [body] * procs, [headers] * procs,
                                  split, [seconds] * procs))

    def load_point(self, label: str, concurrency: int, body: bytes, headers: dict[str, str],
                   duration_s: float, warmup_s: float) -> None:
        if warmup_s > 0:
            self._clients(concurrency, body, headers, warmup_s)
        groups = list(self.stack.groups.values())
        stats0 = self.stack.stats(MODEL)
        cpu0 = group_cpu_s(groups)
        util = GpuSampler(self.args.device)
        util.start()
        results = self._clients(concurrency, body, headers, duration_s)
        util.stop()
        cpu1 = group_cpu_s(groups)
        stats1 = self.stack.stats(MODEL)
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
            p99_ms=round(_pct(latencies, 0.99), 2) if latencies else None,
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

    def e2e_phase(self) -> None:
        self.correctness()
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
                             if ln.startswith(("conveyor_batch_size_sum", "conveyor_batch_size_count",
                                               "conveyor_requests_total", "conveyor_oom"))
                             and f'model="{MODEL}"' in ln])

    def load_point_warm(self, concurrency: int, body: bytes, headers: dict[str, str],
                        seconds: float) -> None:
        started = time.monotonic()
        results = self._clients(concurrency, body, headers, seconds)
        self.rec.emit("e2e_warmup", concurrency=concurrency, seconds=round(time.monotonic() - started, 1),
                      ok=sum(len(r["latencies"]) for r in results),
                      errors=sum(r["errors"] for r in results),
                      error_samples=[s for r in results for s in r["error_samples"]][:3])

    # ----- phase 4
    def oom_phase(self) -> None:
        args = self.args
        result = oom_waves(self.stack, args.oom_waves, args.oom_concurrency, args.oom_rows,
                           simulated=not args.device.startswith("cuda"))
        for wave in result.waves:
            self.rec.emit("oom_wave", **wave)
        self.rec.emit("oom_result", passed=result.passed, simulated=result.simulated,
                      limit_rows=result.limit_rows, all_requests_ok=not result.failures,
                      row_caps=result.row_caps, oom_count=result.oom_count,
                      # rows taken per batch; a batch above the cap ran as OOM-split halves
                      taken_batch_sizes=result.taken_batch_sizes, heartbeat=result.heartbeat,
                      dead_letter=result.dead_letter,
                      worker_alive=self.stack.heartbeats(MODEL) != [])
        if not result.passed:
            raise RuntimeError(f"OOM check failed: ok={not result.failures} "
                               f"caps={result.row_caps} oom_count={result.oom_count}")

    # ----- the whole run
    def run(self) -> int:
        args = self.args
        signal.signal(signal.SIGTERM, _terminated)
        try:
            self.phases.run("env", 30, self.env_phase)
            if "raw" not in args.skip:
                self.phases.run("raw", args.raw_limit, self.raw_phase)
            wants_stack = "e2e" not in args.skip or "oom" not in args.skip
            if wants_stack and self.phases.run("stack", args.ready_timeout + 20, self.start_stack):
                if "e2e" not in args.skip:
                    self.phases.run("e2e", args.e2e_limit, self.e2e_phase, reserve_s=70)
                if "oom" not in args.skip:
                    self.phases.run("oom", args.oom_limit, self.oom_phase)
        except BaseException as exc:  # SIGTERM from the outer timeout, Ctrl-C
            self.rec.emit("aborted", error=f"{type(exc).__name__}: {exc}")
        finally:
            signal.alarm(0)
            self.shutdown()
        self.rec.emit("summary", phases=self.phases.status,
                      seconds=round(time.monotonic() - self.rec.started, 1))
        args.report.write_text(markdown(self.rec, args))
        return 0 if all(v == "ok" for v in self.phases.status.values()) else 1

    def shutdown(self) -> None:
        if self.pool is not None:
            procs = list((getattr(self.pool, "_processes", None) or {}).values())
            self.pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                with contextlib.suppress(Exception):
                    proc.kill()
        with contextlib.suppress(Exception):
            self.stack.stop()
        (self.args.out / "services.log").write_text(self.stack.tails(20000))


def _commit() -> str:
    """The commit this tree is (a snapshot's COMMIT file, else git), and whether it is dirty."""
    with contextlib.suppress(OSError):
        return (ROOT / "COMMIT").read_text().strip() + " (snapshot)"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    return "unknown"


def _noop(_: int) -> None:
    return None


def markdown(rec: Recorder, args: argparse.Namespace) -> str:
    env = next(iter(rec.find("env")), {})
    seconds = rec.find("summary")[-1]["seconds"] if rec.find("summary") else "?"
    lines = [f"# GPU ({env.get('gpu', args.device)}) results", "",
             f"Produced by `{' '.join(['python -m bench.gpu_bench', *sys.argv[1:]])}` (which "
             f"`bash bench/gpu_bench.sh` runs on a GPU machine) in one run of {seconds} s; the "
             "correctness checks are the GPU tests, `make test-gpu`. The CPU benchmark is in "
             "[RESULTS.md](RESULTS.md).", ""]
    lines += [f"- commit: {env.get('commit')}",
              f"- device: {env.get('gpu', args.device)} ({env.get('gpu_memory_gib', '?')} GiB, "
              f"{env.get('multiprocessors', '?')} SMs, capability {env.get('capability', '?')}); "
              f"nvidia-smi: {env.get('nvidia_smi', '-')}",
              f"- host: {env.get('cpus')} CPUs, {env.get('platform')}, Python {env.get('python')}, "
              f"torch {env.get('torch')} (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, "
              f"cudnn.benchmark {env.get('cudnn_benchmark')})",
              "- packages: " + ", ".join(f"{k} {v}" for k, v in (env.get("packages") or {}).items()),
              ""]
    raws = rec.find("raw")
    if raws:
        batches = list(raws[0]["rows_per_s"])
        lines += [f"### Raw model: {NETS[args.net][0]}, uint8 224×224×3 in, "
                  f"{(rec.find('raw_model') or [{}])[0].get('dtype', '?')}, channels_last", "",
                  "| variant | input | batch-1 p50 ms | batch-1 p99 ms | "
                  + " | ".join(f"rows/s @{b}" for b in batches) + " |",
                  "|---|---|---|---|" + "---|" * len(batches)]
        for r in raws:
            cells = [f"{r['rows_per_s'][b]:,}" if b in r["rows_per_s"] else "-" for b in batches]
            lines.append(f"| {r['variant']} | {r['input']} | {r['batch1']['p50_ms']:.2f} | "
                         f"{r['batch1']['p99_ms']:.2f} | " + " | ".join(cells) + " |")
        lines.append("")
    points = [r for r in rec.find("e2e") if "skipped" not in r]
    if points:
        lines += [f"### conveyor end to end: {MODEL} (TorchScript) on "
                  f"{args.device}, {args.api_workers} API processes, 1 inference process", "",
                  "| protocol | c | req/s | p50 ms | p99 ms | errors | mean batch | "
                  "mean batch per request | GPU util % | CPU s (api / worker / redis) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for p in points:
            util = (p.get("gpu_util") or {}).get("util_mean_pct", "-")
            cpu = p.get("cpu_s", {})
            lines.append(f"| {p['protocol']} | {p['concurrency']} | {p['req_per_s']:,.0f} | "
                         f"{p['p50_ms']} | {p['p99_ms']} | {p['errors']} | {p['mean_batch']} | "
                         f"{p['mean_batch_per_request']} | {util} | "
                         f"{cpu.get('api', '-')} / {cpu.get('worker', '-')} / {cpu.get('redis', '-')} |")
        lines.append("")
    for r in rec.find("oom_result"):
        lines += ["### OOM on the device", "",
                  f"- passed: **{r['passed']}** (simulated: {r['simulated']}); limit "
                  f"{r['limit_rows']} rows; all requests answered 200 and right: "
                  f"{r['all_requests_ok']}; oom_count {r['oom_count']}; heartbeat row_cap "
                  f"{r['row_caps']}; batches taken by size (before OOM splits) {r['taken_batch_sizes']}", ""]
    lines += ["Phases: " + ", ".join(f"{k}: {v}" for k, v in rec.find("summary")[-1]["phases"].items())
              if rec.find("summary") else "", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT") or ROOT / "bench" / "out" / "gpu"))
    parser.add_argument("--report", type=Path, default=None,
                        help="the tables (default: bench/RESULTS-gpu.md on a CUDA device, "
                             "OUT/gpu.md with --quick or on a CPU)")
    parser.add_argument("--net", choices=sorted(NETS), default="resnet50")
    parser.add_argument("--budget-s", type=float, default=330)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and durations (CPU dry run)")
    parser.add_argument("--skip", type=lambda s: set(s.split(",")), default=set(),
                        help="phases to skip: raw, e2e, oom")
    parser.add_argument("--raw-batches", type=ints, default=[1, 8, 32, 64, 128])
    parser.add_argument("--raw-seconds", type=float, default=1.0)
    parser.add_argument("--latency-calls", type=int, default=200)
    parser.add_argument("--raw-limit", type=float, default=120)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--api-workers", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--concurrency", type=ints, default=[1, 16, 64])
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--warmup", type=float, default=2)
    parser.add_argument("--first-warmup", type=float, default=5,
                        help="seconds at the highest concurrency before the first point")
    parser.add_argument("--json-concurrency", type=int, default=16, help="0: no JSON point")
    parser.add_argument("--json-duration", type=float, default=5)
    parser.add_argument("--ready-timeout", type=float, default=150)
    parser.add_argument("--e2e-limit", type=float, default=150)
    parser.add_argument("--oom-rows", type=int, default=8)
    parser.add_argument("--oom-concurrency", type=int, default=64)
    parser.add_argument("--oom-waves", type=int, default=3)
    parser.add_argument("--oom-limit", type=float, default=90)
    parser.add_argument("--redis-server", default=os.environ.get("CONVEYOR_GPU_REDIS_SERVER",
                                                                 "redis-server"))
    parser.add_argument("--redis-ld", default=os.environ.get("CONVEYOR_GPU_REDIS_LD", ""))
    args = parser.parse_args()
    if args.quick:
        args.raw_batches, args.raw_seconds, args.latency_calls = [1, 2], 0.2, 3
        args.max_batch, args.api_workers, args.clients = 8, 1, 2
        args.concurrency, args.duration, args.warmup, args.first_warmup = [1, 4], 2, 0.5, 1
        args.json_concurrency, args.json_duration = 2, 1
        args.oom_rows, args.oom_concurrency, args.oom_waves = 4, 16, 2
    if args.report is None:
        dry_run = args.quick or not args.device.startswith("cuda")
        args.report = args.out / "gpu.md" if dry_run else ROOT / "bench" / "RESULTS-gpu.md"
    sys.exit(Bench(args).run())


if __name__ == "__main__":
    main()
