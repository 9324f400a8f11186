"""Batching policies on the real stack: goodput of the adaptive policy against fixed windows,
under open-loop Poisson and on/off arrivals, with the simulator's prediction beside each point.

Usage: python -m bench.sweep [--models mlp_medium,mlp_tiny,device] [--loads 10,30,50,70,85,95,110,125]
                             [--fixed 0,1000,2000,5000,10000,20000] [--arrivals poisson,on-off]
                             [--point-s 4] [--warmup-s 1] [--target-ms 50] [--timeout-ms T]
                             [--max-lag-ms 5]
                             [--repeats 1] [--slices 1] [--triton] [--out bench/RESULTS-batching.md]

Per model: conveyor (redis-server, ``python -m api.serve``, one Celery worker) with the
adaptive policy and the first fixed window measure the closed-loop capacity (the most req/s
answered 200 by 64 or 256 connections on either stack: closed-loop, lifo refuses what waits
past the target, so the adaptive stack's alone understates it) and the adaptive stack the
whole-path batch time its policy learned (``t(n) = a + b·n``); every policy's stack
runs beside it, and at every arrival pattern and load (a share of that capacity) each policy
takes its turn, in an order rotated from one point to the next (``--repeats`` rounds of
turns; each policy's point is then its run of median goodput). With ``--slices K`` a run
is K slices of ``--point-s`` (each after its own warm-up), the policies taking turns slice
by slice, every policy given the same arrivals in its k-th slice, pooled: this host's speed
drifts by 10-25% within a minute, even idle, and at loads near capacity that alone moves a
point's goodput by more than the policies differ; in short turns over the same stretch of
time, every policy meets the same drift. Requests carry
``parameters.timeout`` = the latency target (a client that wants its answer within the target
says so), or ``--timeout-ms``. Goodput = answers with status 200 within the target, per second. The generator
(bench.open_loop) reports its own CPU and send lag; a point whose send lag p99 exceeds
``--max-lag-ms`` is refused (marked, and left out of the verdict). The simulator
(bench.scheduler_sim.run_loop) gets the same send times, a device with the learned ``t(n)`` and
the same policy, and the fixed path outside the worker (c=1 latency minus ``t(1)``) added to
every answer. With ``--triton``, NVIDIA Triton's dynamic batcher serves the MLPs as one more
row (bench/triton.py), rejecting what has waited the target in its queue."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import uvloop

from batching.adaptive import AdaptivePolicy
from batching.policy import FixedWindow, Policy
from bench import device_model, open_loop, quiet, triton
from bench import run as base
from bench.models import LAYERS, MAX_BATCH_SIZE, write_repository
from bench.scheduler_sim import Device, run_loop
from bench.sweep_report import Point, Setting, median_run, report
from conveyor.harness import RedisServer, free_port

ARRIVALS: dict[str, Callable[[float, float, int], list[float]]] = {
    "poisson": lambda rate, seconds, seed: open_loop.poisson(rate, seconds, seed),
    "on-off": lambda rate, seconds, seed: open_loop.on_off(rate, seconds, 0.1, 0.1, seed),
}
"""Send times by pattern; on-off: 100 ms at twice the rate, then 100 ms silent."""
ADAPTIVE_BOUND_US = 20000
QUIET_EXTRA_S = 2.0
"""Between runs, the host is waited for until quiet (bench/quiet.py), at most a request's
timeout and this long: the queue a run left expires within its timeout."""
SLICE_SEED = 7919
"""The arrivals of a point's slice ``k`` are drawn from the point's seed + k times this:
every policy gets the same ones."""


@dataclass
class Stack:
    host: str
    port: int
    model: str
    body: bytes

    @property
    def path(self) -> str:
        return f"/v2/models/{self.model}/infer"

    def metric(self, *names: str) -> list[float]:
        """The model's value of each of ``names`` on /metrics (0 where absent)."""
        url = f"http://{self.host}:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()

        def value(name: str) -> float:
            found = re.search(rf'^{name}{{[^}}]*model="{self.model}"[^}}]*}} (\S+)$', text, re.M)
            return float(found.group(1)) if found else 0.0

        return [value(name) for name in names]

    def estimates(self) -> tuple[float, float]:
        """The worker's learned ``(a, b)`` of ``t(n) = a + b·n``, from /metrics."""
        a, b = self.metric("conveyor_policy_latency_intercept_seconds",
                           "conveyor_policy_latency_slope_seconds")
        return a, b


def request_body(model: str, timeout_us: int) -> bytes:
    body = (device_model.request_body() if model == device_model.NAME
            else json.loads(base.request_body(model)))
    body["parameters"] = {"timeout": timeout_us}
    return json.dumps(body).encode()


def write_config(repo: Path, model: str, setting: Setting, target_ms: float) -> None:
    """The model's ``config.yaml``: only its batching section (the device model's also
    declares its tensors)."""
    delay = ADAPTIVE_BOUND_US if setting.adaptive else setting.delay_us
    declared = device_model.CONFIG if model == device_model.NAME else ""
    (repo / model / "config.yaml").write_text(
        declared + f"batching:\n  max_queue_delay_us: {delay}\n  adaptive: {str(setting.adaptive).lower()}\n"
        f"  latency_target_ms: {target_ms:g}\n")


@contextmanager
def conveyor(model: str, repo: Path, work: Path, body: bytes) -> Iterator[Stack]:
    """redis-server, ``python -m api.serve`` and one Celery worker serving ``model``."""
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    with ExitStack() as stack:
        rds = stack.enter_context(RedisServer(work))
        env = {**os.environ, "CONVEYOR_REDIS_URL": rds.url, "CONVEYOR_MODEL_REPOSITORY": str(repo),
               "CONVEYOR_MODELS": model, "CONVEYOR_HTTP_PORT": str(port),
               "CONVEYOR_GRPC_PORT": str(free_port()), "CONVEYOR_WORKER_PORT": str(free_port()),
               "CONVEYOR_HEARTBEAT_INTERVAL_S": "0.5", "PYTHONUNBUFFERED": "1"}
        groups = [base.server("api", [sys.executable, "-m", "api.serve"], env, work),
                  base.server("celery", [sys.executable, "-m", "celery", "-A", "workers.app", "worker",
                                         "-n", f"sweep-{port}@%h", "--loglevel", "WARNING",
                                         "--without-mingle", "--without-gossip"], env, work)]
        stack.enter_context(base.started(groups, lambda: base.http_ok(f"{root}/v2/health/ready")
                                         and base.http_ok(f"{root}/v2/models/{model}/infer", body)))
        yield Stack("127.0.0.1", port, model, body)


@contextmanager
def triton_stack(model: str, exported: Path, work: Path, body: bytes, setting: Setting,
                 target_ms: float) -> Iterator[Stack]:
    """NVIDIA Triton serving ``model`` in its Python backend (bench/triton.py), its dynamic
    batcher waiting ``setting.delay_us`` and rejecting what has waited ``target_ms`` in its
    queue (its best queue timeout for answers within the target; a request's own timeout is
    not allowed to override it)."""
    venv = triton.ensure_venv()
    ports = (free_port(), free_port(), free_port())
    argv, env = triton.python_backend_server(
        venv, work, exported / model / "model.onnx", model, (LAYERS[model][0], LAYERS[model][-1]),
        MAX_BATCH_SIZE, ports, setting.delay_us, int(target_ms * 1000))
    stack = Stack("127.0.0.1", ports[0], model, body)
    url = f"http://{stack.host}:{stack.port}{stack.path}"
    with base.started([base.server("tritonserver", argv, env, work)],
                      lambda: base.http_ok(url, body)):
        yield stack


def connections_for(rate: float) -> int:
    """Keep-alive connections opened in advance for ``rate`` requests a second."""
    return max(64, min(2000, int(rate * 0.1)))


def drive(stack: Stack, times: list[float], warmup_s: float, connections: int) -> open_loop.Outcome:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(open_loop.run(stack.host, stack.port, stack.path, stack.body, times,
                                        connections, warmup_s=warmup_s))


def closed_rps(stack: Stack, connections: int, seconds: float) -> tuple[float, float]:
    """(req/s, p50 ms) with ``connections`` clients each sending as soon as answered."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        out = runner.run(open_loop.closed(stack.host, stack.port, stack.path, stack.body,
                                          connections, seconds))
    ordered = sorted(out.latencies_ms)
    return out.count(200) / seconds, ordered[len(ordered) // 2] if ordered else float("nan")


def capacity_rps(stack: Stack, seconds: float) -> float:
    """Closed-loop capacity: the more the connections, the bigger the batches, so the most
    that 64 or 256 connections get answered per second."""
    return max(closed_rps(stack, c, seconds)[0] for c in (64, 256))


def max_rows(model: str) -> int:
    """The model's ``max_batch_size``: conveyor's default for the MLPs."""
    return device_model.MAX_BATCH_SIZE if model == device_model.NAME else MAX_BATCH_SIZE


def make_policy(setting: Setting, target_s: float, rows: int) -> Policy:
    if setting.adaptive:
        return AdaptivePolicy(rows, ADAPTIVE_BOUND_US / 1e6, latency_target_s=target_s)
    return FixedWindow(rows, setting.delay_us / 1e6)


def predict(setting: Setting, times: list[float], seconds: float, device: Device, path_s: float,
            target_s: float, rows: int, timeout_s: float) -> float:
    """The simulator's goodput (req/s) for the same send times over all ``seconds``: a
    request reaches the worker half the fixed path after it is sent, its deadline stays the
    API's (sent + timeout; the adaptive policy's due time sent + target), and its answer
    counts if the worker's latency plus the whole fixed path is within the target."""
    policy = make_policy(setting, target_s, rows)
    policy.observe_path(path_s)  # as the API reports it to the real stack's policy
    out = run_loop([t + path_s / 2 for t in times], device, policy, rows,
                   timeout_s=timeout_s - path_s / 2,
                   target_s=target_s - path_s / 2 if setting.adaptive else None)
    return float((out.latency + path_s <= target_s).sum()) / seconds


@dataclass
class Slice:
    """One policy's run of one stretch of a point's arrivals."""

    out: open_loop.Outcome
    predicted: float
    """The simulator's goodput (req/s) for the same send times."""


def run_slice(stack: Stack, setting: Setting, pattern: str, share: float, capacity: float,
              args: argparse.Namespace, device: Device, path_s: float, seed: int) -> Slice:
    """``args.warmup_s`` then ``args.point_s`` of ``pattern`` arrivals at ``share`` of
    ``capacity``, drawn from ``seed``."""
    rate = share * capacity
    seconds = args.warmup_s + args.point_s
    times = ARRIVALS[pattern](rate, seconds, seed)
    out = drive(stack, times, args.warmup_s, connections_for(rate))
    return Slice(out, predict(setting, times, seconds, device, path_s, args.target_ms / 1e3,
                              max_rows(stack.model), args.timeout_ms / 1e3))


def percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``ordered``; NaN when empty."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def point_of(setting: Setting, pattern: str, share: float, slices: list[Slice],
             args: argparse.Namespace) -> Point:
    """One policy's point: its slices' requests pooled."""
    out = open_loop.pooled([piece.out for piece in slices])
    measured_s = args.point_s * len(slices)
    ok_ms = sorted(ms for s, ms in zip(out.statuses, out.latencies_ms, strict=True) if s == 200)
    point = Point(
        setting=setting.label, pattern=pattern, share=share, offered=out.sent / measured_s,
        goodput=out.good(args.target_ms) / measured_s,
        predicted=sum(piece.predicted for piece in slices) / len(slices),
        p99_ms=percentile(ok_ms, 0.99),
        ok=out.count(200), late_or_shed=out.count(504), other=len(out.statuses) - out.count(200)
        - out.count(503) - out.count(504), gen_cpu=out.cpu_share, lag_p99_ms=out.lag_p99_ms(),
        refused=out.lag_p99_ms() > args.max_lag_ms, overloaded=out.count(503), lost=out.lost,
        p99_all_ms=percentile(sorted(out.latencies_ms), 0.99))
    print(f"  {point.line()}", file=sys.stderr, flush=True)
    return point


def measure(stack: Stack, setting: Setting, pattern: str, share: float, capacity: float,
            args: argparse.Namespace, device: Device, path_s: float) -> Point:
    """One policy's point in one run (one slice)."""
    piece = run_slice(stack, setting, pattern, share, capacity, args, device, path_s,
                      round(share * 1000))
    return point_of(setting, pattern, share, [piece], args)


def schedule(settings: list[Setting], slices: int, turn: int) -> list[tuple[int, Setting]]:
    """One round's runs in order, as (slice, policy): slice by slice, every policy once in
    each, the order rotated by one from slice to slice, the first rotated by ``turn``."""
    order: list[tuple[int, Setting]] = []
    for index in range(slices):
        first = (turn + index) % len(settings)
        order += [(index, setting) for setting in settings[first:] + settings[:first]]
    return order


def sweep_model(model: str, work: Path, args: argparse.Namespace) -> dict[str, object]:
    """Every policy's stack side by side (an idle one costs next to nothing), the adaptive
    one measuring the capacity and the batch time it learned; then, at each pattern and
    load, every policy in turn, the order rotated from one point to the next. A host whose
    speed drifts over the sweep then favours no policy: run one after the other, the last
    policy met a different host than the first."""
    body = request_body(model, int(args.timeout_ms * 1000))
    adaptive = Setting(True, 0)
    settings = [adaptive, *(Setting(False, d) for d in args.fixed)]
    if args.triton and model in LAYERS:
        settings.append(Setting(False, args.fixed[0], triton=True))
    exported = work / "exported"
    if not exported.exists():
        write_repository(exported)
        device_model.write(exported)
    with ExitStack() as stacks:
        served: dict[Setting, Stack] = {}
        for setting in settings:
            folder = work / model / setting.label.replace(" ", "-")
            if setting.triton:
                folder.mkdir(parents=True)
                served[setting] = stacks.enter_context(triton_stack(
                    model, exported, folder, body, setting, args.target_ms))
                continue
            # The models exported once, hard-linked into each stack's repository; its own
            # config.yaml is a new file (the export has none), so no stack sees another's.
            shutil.copytree(exported, folder / "repo", copy_function=os.link)
            write_config(folder / "repo", model, setting, args.target_ms)
            served[setting] = stacks.enter_context(conveyor(model, folder / "repo", folder, body))
        learned = served[adaptive]
        closed_rps(learned, 64, args.warmup_s + 1)
        capacity = capacity_rps(learned, args.capacity_s)
        time.sleep(1.0)  # a heartbeat carries the policy's fit to the API
        a, b = learned.estimates()
        _, c1_ms = closed_rps(learned, 1, 2.0)
        device = Device(f"{model} (learned)", base_s=a, per_row_s=b)
        path_s = max(0.0, c1_ms / 1e3 - device.seconds(1))
        for setting in settings[1:]:
            closed_rps(served[setting], 64, args.warmup_s)
        if args.fixed:
            # Closed-loop, the adaptive policy's lifo refuses what waits past the target, so
            # its 200s alone understate what the model serves; the first fixed window
            # refuses nothing: the better of the two is the capacity.
            capacity = max(capacity, capacity_rps(served[settings[1]], args.capacity_s))
        print(f"{model}: capacity {capacity:.0f} req/s, t(n) = {a * 1e3:.2f} ms + {b * 1e3:.3f} "
              f"ms·n, fixed path {path_s * 1e3:.2f} ms", file=sys.stderr, flush=True)
        points: list[Point] = []
        at = [(pattern, share) for pattern in args.arrivals for share in args.loads]
        turn = 0
        for pattern, share in at:
            runs: dict[Setting, list[Point]] = {setting: [] for setting in settings}
            for _ in range(args.repeats):
                slices: dict[Setting, list[Slice]] = {setting: [] for setting in settings}
                for index, setting in schedule(settings, args.slices, turn):
                    # what the last run left queued past capacity is not the next one's
                    quiet.wait_quiet(args.timeout_ms / 1e3 + QUIET_EXTRA_S)
                    slices[setting].append(run_slice(
                        served[setting], setting, pattern, share, capacity, args, device,
                        path_s, round(share * 1000) + SLICE_SEED * index))
                turn += args.slices
                for setting in settings:
                    runs[setting].append(point_of(setting, pattern, share, slices[setting], args))
            points += [median_run(runs[setting]) for setting in settings]
    labels = [setting.label for setting in settings]
    points.sort(key=lambda p: labels.index(p.setting))  # the report's order: policy by policy
    return {"model": model, "capacity": capacity, "a": a, "b": b, "path_s": path_s, "points": points}


def words(text: str) -> list[str]:
    return text.split(",")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--models", type=words, default=["mlp_medium", "mlp_tiny", device_model.NAME])
    parser.add_argument("--loads", type=lambda s: [int(v) / 100 for v in words(s)],
                        default=[0.1, 0.3, 0.5, 0.7, 0.85, 0.95, 1.1, 1.25], help="%% of capacity")
    parser.add_argument("--fixed", type=lambda s: [int(v) for v in words(s)],
                        default=[0, 1000, 2000, 5000, 10000, 20000],
                        help="max_queue_delay_us of the fixed windows")
    parser.add_argument("--arrivals", type=words, default=list(ARRIVALS))
    parser.add_argument("--point-s", type=float, default=4.0)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--capacity-s", type=float, default=5.0)
    parser.add_argument("--target-ms", type=float, default=50.0)
    parser.add_argument("--timeout-ms", type=float, default=None,
                        help="each request's parameters.timeout (default: the target)")
    parser.add_argument("--max-lag-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds per pattern and load; a policy's point is its median run")
    parser.add_argument("--slices", type=int, default=1,
                        help="a run of each policy at a point is this many slices of "
                             "--point-s, the policies taking turns slice by slice, pooled")
    parser.add_argument("--triton", action="store_true",
                        help="on the MLPs, NVIDIA Triton's dynamic batcher as a row too (the "
                             "first --fixed window, rejecting what waited the target in its queue)")
    parser.add_argument("--out", type=Path, default=base.ROOT / "bench" / "RESULTS-batching.md")
    args = parser.parse_args()
    if args.timeout_ms is None:
        args.timeout_ms = args.target_ms
    started_at = datetime.now(UTC)
    load0 = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    results = []
    with tempfile.TemporaryDirectory(prefix="conveyor-sweep-") as tmp:
        results = [sweep_model(model, Path(tmp), args) for model in args.models]
    args.out.write_text(report(results, args, started_at, load0))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
