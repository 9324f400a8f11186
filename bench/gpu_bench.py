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
         a python model), redis-server, the API (python -m api.serve, N processes) and a
         Celery worker (bench/gpu_stack.py); one request of each protocol compared with the
         raw model's logits, then KServe v2 binary-tensor requests from wrk (or Python
         client processes, --load python) at each concurrency (and one JSON point).
   plain: the same binary load against the plain FastAPI wrapper (bench/gpu_plain.py),
         one TorchScript call per request, on the same device.
   redis: the stack again with CONVEYOR_TENSOR_ARENA_MB=0 (every input through Redis),
         the two highest concurrencies again.
4. oom:  waves of concurrent requests to ``oomtest``, whose predict allocates on the device
         in proportion to its rows so that more than --oom-rows rows cannot fit: whether
         every request succeeded, the learned row caps (heartbeat ``row_cap``) and
         ``oom_count`` of the stats hash.

Every record is one JSON line on stdout and in OUT/gpu.json; the report (--report: by default
bench/RESULTS-gpu.md on a CUDA device, OUT/gpu.md for a dry run) holds the tables, and
OUT/services.log the servers' log tails.

This module runs the phases in order; each job has its module: the records and time boxes
(bench/gpu_record.py), env (bench/gpu_env.py), raw (bench/gpu_raw.py), e2e (bench/gpu_e2e.py,
its clients in bench/gpu_load.py), the stack and the OOM waves (bench/gpu_stack.py), and the
report (bench/gpu_report.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu_e2e import EndToEnd
from bench.gpu_env import ROOT, environment
from bench.gpu_models import BENCH_MODEL, NETS, binary_request, seeded_images
from bench.gpu_raw import RawPhase
from bench.gpu_record import Phases, Recorder
from bench.gpu_report import markdown
from bench.gpu_stack import GpuStack, oom_waves


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(f"signal {signum}")


class Bench:
    """The phases in order, on one model repository and one serving stack."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rec = Recorder(args.out)
        self.phases = Phases(self.rec, args.budget_s)
        self.work = Path(tempfile.mkdtemp(prefix="conveyor-gpu-"))
        self.stack = GpuStack(self.work / "repo", self.work / "logs", args.api_workers,
                              args.redis_server, args.redis_ld)
        self.raw = RawPhase(self.rec, args, self.stack.repo)
        self.e2e = EndToEnd(self.rec, args, self.stack, self.phases)

    # ----- phase 1
    def env_phase(self) -> None:
        self.rec.emit("env", **environment(self.args.device))

    # ----- phase 3
    def start_stack(self) -> None:
        args = self.args
        if not (self.stack.repo / BENCH_MODEL / "model.pt").exists():
            raise RuntimeError("no model repository: the raw phase did not export the model")
        started = time.monotonic()
        self.stack.start(args.ready_timeout)
        self.rec.emit("stack_ready", seconds=round(time.monotonic() - started, 1),
                      api_workers=args.api_workers, workers=self.stack.heartbeats(BENCH_MODEL))
        self.e2e.start_clients()

    def e2e_phase(self) -> None:
        self.e2e.run(self.raw.reference, self.raw.many)

    def plain_phase(self) -> None:
        self.e2e.plain(self.stack.repo / BENCH_MODEL / "model.pt")

    def redis_phase(self) -> None:
        """The binary points again with every input through Redis (no tensor arena)."""
        args = self.args
        self.stack.stop()
        self.stack.extra_env = {"CONVEYOR_TENSOR_ARENA_MB": "0"}
        self.stack.start(args.ready_timeout)
        body, headers = binary_request(seeded_images(1, seed=7))
        for c in args.concurrency[-2:]:
            self.e2e.load_point("binary, through Redis", c, body, headers, args.duration,
                                args.warmup)

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
                      worker_alive=self.stack.heartbeats(BENCH_MODEL) != [])
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
                self.phases.run("raw", args.raw_limit, self.raw.run)
            wants_stack = "e2e" not in args.skip or "oom" not in args.skip
            if wants_stack and self.phases.run("stack", args.ready_timeout + 20, self.start_stack):
                if "e2e" not in args.skip:
                    self.phases.run("e2e", args.e2e_limit, self.e2e_phase, reserve_s=70)
                if "plain" not in args.skip:
                    self.phases.run("plain", args.plain_limit, self.plain_phase)
                if "redis" not in args.skip:
                    self.phases.run("redis", args.ready_timeout + 60, self.redis_phase)
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
        self.e2e.stop_clients()
        with contextlib.suppress(Exception):
            self.stack.stop()
        (self.args.out / "services.log").write_text(self.stack.tails(20000))


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
                        help="phases to skip: raw, e2e, plain, redis (the binary points "
                             "with the tensor arena off), oom")
    parser.add_argument("--raw-batches", type=ints, default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--raw-seconds", type=float, default=1.0)
    parser.add_argument("--latency-calls", type=int, default=200)
    parser.add_argument("--raw-limit", type=float, default=120)
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--api-workers", type=int, default=8)
    parser.add_argument("--instances", type=int, default=1,
                        help="inference processes of the classifier on the device (its count)")
    parser.add_argument("--load", choices=("wrk", "python"), default="wrk",
                        help="the load generator: wrk (C, closed loop) or Python client processes")
    parser.add_argument("--wrk-threads", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4, help="client processes (--load python)")
    parser.add_argument("--concurrency", type=ints, default=[64, 256, 512])
    parser.add_argument("--plain-concurrency", type=ints, default=[64, 256])
    parser.add_argument("--plain-limit", type=float, default=60)
    parser.add_argument("--profile-s", type=float, default=0,
                        help="py-spy the API and worker this long at the top concurrency (0: no)")
    parser.add_argument("--duration", type=float, default=8)
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
        args.plain_concurrency, args.wrk_threads = [4], 1
        args.json_concurrency, args.json_duration = 2, 1
        args.oom_rows, args.oom_concurrency, args.oom_waves = 4, 16, 2
    if args.report is None:
        dry_run = args.quick or not args.device.startswith("cuda")
        args.report = args.out / "gpu.md" if dry_run else ROOT / "bench" / "RESULTS-gpu.md"
    sys.exit(Bench(args).run())


if __name__ == "__main__":
    main()
