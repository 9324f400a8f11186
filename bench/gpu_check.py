"""GPU check: the raw ResNet-50 ceiling, conveyor end to end on the GPU, real CUDA OOM.

Usage: bash bench/gpu_check.sh                      (on the GPU machine: sets up redis-server
                                                     and the wheels first, see that file)
       python -m bench.gpu_check --device cpu --quick   (a dry run of every step on a CPU)

Phases, each time-boxed, each failure recorded and the next phase run anyway:

1. env:  torch, the device, package versions.
2. raw:  ResNet-50 (torchvision, weights=None, seeded, eval) behind a wrapper that takes
         uint8 NHWC images and normalises on the device; FP16 + channels_last on CUDA.
         Batch-1 latency and rows/s at several batch sizes, eager and TorchScript (traced),
         with the input already on the device; then conveyor's own backend (load_model +
         predict: numpy in, copies both ways, numpy out), i.e. the inference process
         without the serving stack.
3. e2e:  a model repository (resnet50: the traced wrapper, torchscript backend; oomtest:
         a python model), redis-server, the API (uvicorn --workers N) and a Celery worker;
         one request checked against the raw model's logits, then KServe v2 binary-tensor
         requests from several client processes at each concurrency (and one JSON point).
4. oom:  waves of concurrent requests to ``oomtest``, whose predict allocates on the device
         in proportion to its rows so that more than --oom-rows rows cannot fit: every
         request must succeed, the worker's learned row cap (heartbeat ``row_cap``) must end
         at or below --oom-rows, and ``oom_count`` in the stats hash must be above 0.

Every record is one JSON line on stdout and in OUT/gpu.json; OUT/gpu.md holds the tables
and OUT/services.log the servers' log tails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
IMAGE_SHAPE = (224, 224, 3)
IMAGE_BYTES = 224 * 224 * 3
TICKS = os.sysconf("SC_CLK_TCK")

RESNET_CONFIG = """\
backend: torchscript
max_batch_size: {max_batch}
inputs:
  - {{name: image, datatype: UINT8, shape: [-1, 224, 224, 3]}}
outputs:
  - {{name: logits, datatype: FP32, shape: [-1, 1000]}}
queue:
  max_queue_rows: 100000
instances:
  - {{device: "{device}", count: 1}}
"""

OOM_CONFIG = """\
backend: python
max_batch_size: 64
inputs:
  - {{name: x, datatype: FP32, shape: [-1, 4]}}
outputs:
  - {{name: y, datatype: FP32, shape: [-1, 4]}}
batching:
  adaptive: false
  max_queue_delay_us: 50000
instances:
  - {{device: "{device}", count: 1}}
parameters:
  oom_rows: {oom_rows}
"""

OOM_MODEL = '''\
"""Allocates on its device in proportion to the batch's rows: more than ``oom_rows`` rows
cannot fit in the memory free at that moment, so such a batch raises a real
torch.cuda.OutOfMemoryError (on a CPU the error is raised without allocating: a dry run)."""

import numpy as np
import torch


class Model:
    def __init__(self, config, device):
        self.device = torch.device(device)
        self.limit = int(config["parameters"]["oom_rows"])
        torch.zeros(1, device=self.device)  # create the context now, not in the first batch

    def predict(self, inputs):
        x = np.array(inputs["x"], dtype=np.float32)
        rows = x.shape[0]
        if self.device.type != "cuda":
            if rows > self.limit:
                raise torch.cuda.OutOfMemoryError(f"simulated: {rows} rows > {self.limit}")
            return {"y": x * 2}
        try:
            free, _total = torch.cuda.mem_get_info(self.device)
            per_row = int(free / (self.limit + 0.5))
            block = torch.empty(rows * per_row, dtype=torch.uint8, device=self.device)
            block[::1 << 20].fill_(1)  # touch it: one byte per MiB
            y = (torch.from_numpy(x).to(self.device) * 2).cpu().numpy()
            del block
            return {"y": y}
        finally:
            torch.cuda.empty_cache()  # give the memory back: the next batch measures free again
'''


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


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def http_get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError as exc:
        return 0, str(exc).encode()


class Server:
    """A server started in its own session, so its whole tree shares one process group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name = name
        self.log_path = logdir / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, chars: int = 6000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            text = f"(no log: {exc})"
        return f"===== {self.name} (pid {self.popen.pid}, rc {self.popen.poll()}) =====\n{text[-chars:]}\n"

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}\n{self.tail(3000)}")

    def cpu_s(self) -> float:
        """utime+stime of every live process of this server's process group."""
        total = 0.0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == self.popen.pid:
                total += (int(fields[11]) + int(fields[12])) / TICKS
        return total

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(15)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


# --------------------------------------------------------------------------- model


def _torch() -> Any:
    import torch

    return torch


def build_classifier(device: str) -> tuple[Any, Any]:
    """The seeded ResNet-50 wrapper (uint8 NHWC in, FP32 logits out) and its compute dtype."""
    torch = _torch()
    import torchvision
    from torch import nn

    dtype = torch.float16 if device.startswith("cuda") else torch.float32

    class Classifier(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net
            mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
            std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
            self.register_buffer("mean", mean.to(dtype))
            self.register_buffer("inv_std", (1 / std).to(dtype))

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            # NHWC bytes -> NCHW view whose strides are already channels_last.
            x = image.permute(0, 3, 1, 2).to(self.mean.dtype)
            x = ((x - self.mean) * self.inv_std).contiguous(memory_format=torch.channels_last)
            return self.net(x).float()

    torch.manual_seed(0)
    net = torchvision.models.resnet50(weights=None).eval()
    model = Classifier(net).to(device=device, dtype=dtype).to(memory_format=torch.channels_last)
    return model.eval(), dtype


def seeded_images(rows: int, seed: int = 1) -> Any:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, size=(rows, *IMAGE_SHAPE), dtype=np.uint8)


def _sync(device: str) -> None:
    torch = _torch()
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


# --------------------------------------------------------------------------- load client


def _client_run(url: str, body: bytes, headers: dict[str, str], conns: int,
                duration_s: float) -> dict[str, Any]:
    """One client process: ``conns`` concurrent request loops for ``duration_s``."""
    return asyncio.run(_drive(url, body, headers, conns, duration_s))


async def _drive(url: str, body: bytes, headers: dict[str, str], conns: int,
                 duration_s: float) -> dict[str, Any]:
    latencies: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    end = start + duration_s
    try:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns),
                                         timeout=timeout) as session:
            async def loop() -> None:
                while (t0 := time.perf_counter()) < end:
                    try:
                        async with session.post(url, data=body, headers=headers) as response:
                            data = await response.read()
                            status = response.status
                    except Exception as exc:
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])
                        continue
                    if status == 200:
                        latencies.append((time.perf_counter() - t0) * 1e3)
                    else:
                        errors.append(f"{status}: {data[:200]!r}")

            await asyncio.gather(*(loop() for _ in range(conns)))
        client = f"aiohttp {aiohttp.__version__}"
    except ImportError:
        import httpx

        limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
        async with httpx.AsyncClient(limits=limits, timeout=60) as session:
            async def loop() -> None:
                while (t0 := time.perf_counter()) < end:
                    try:
                        response = await session.post(url, content=body, headers=headers)
                    except Exception as exc:
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])
                        continue
                    if response.status_code == 200:
                        latencies.append((time.perf_counter() - t0) * 1e3)
                    else:
                        errors.append(f"{response.status_code}: {response.content[:200]!r}")

            await asyncio.gather(*(loop() for _ in range(conns)))
        client = f"httpx {httpx.__version__}"
    return {"latencies": latencies, "errors": len(errors), "error_samples": errors[:3],
            "elapsed_s": time.perf_counter() - start, "client": client}


def binary_request(images: Any) -> tuple[bytes, dict[str, str]]:
    header = json.dumps({
        "inputs": [{"name": "image", "datatype": "UINT8", "shape": list(images.shape),
                    "parameters": {"binary_data_size": int(images.nbytes)}}],
        "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
    }).encode()
    return header + images.tobytes(), {"Inference-Header-Content-Length": str(len(header)),
                                       "Content-Type": "application/octet-stream"}


def json_request(images: Any) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"inputs": [{"name": "image", "datatype": "UINT8",
                                   "shape": list(images.shape),
                                   "data": images.reshape(-1).tolist()}]}).encode()
    return body, {"Content-Type": "application/json"}


def decode_logits(body: bytes, header_length: str | None) -> Any:
    import numpy as np

    if header_length is None:
        doc = json.loads(body)
        return np.asarray(doc["outputs"][0]["data"], dtype=np.float32).reshape(-1, 1000)
    length = int(header_length)
    return np.frombuffer(body[length:], dtype=np.float32).reshape(-1, 1000)


# --------------------------------------------------------------------------- the check


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rec = Recorder(args.out)
        self.phases = Phases(self.rec, args.budget_s)
        self.work = Path(tempfile.mkdtemp(prefix="conveyor-gpu-"))
        self.repo = self.work / "repo"
        self.servers: list[Server] = []
        self.reference: Any = None  # eager logits of seeded_images(1)
        self.pool: ProcessPoolExecutor | None = None
        self.redis_port = 0
        self.base = ""
        self.env: dict[str, str] = {}

    # ----- phase 1
    def env_phase(self) -> None:
        torch = _torch()
        info: dict[str, Any] = {
            "python": sys.version.split()[0], "executable": sys.executable,
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
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

        versions = {}
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
        torch = _torch()
        args = self.args
        device = args.device
        model, dtype = build_classifier(device)
        self.rec.emit("raw_model", dtype=str(dtype), memory_format="channels_last",
                      params=sum(p.numel() for p in model.parameters()))
        one = torch.from_numpy(seeded_images(1)).to(device)
        with torch.inference_mode():
            self.reference = model(one).cpu().numpy()
            finite = bool(torch.isfinite(torch.from_numpy(self.reference)).all())
            self.rec.emit("raw_reference", finite=finite,
                          argmax=int(self.reference.argmax()),
                          logit_absmax=float(abs(self.reference).max()))
        traced = self._export(model, device)
        with torch.inference_mode():
            for variant, module in (("eager", model), ("torchscript", traced)):
                lat = time_calls(lambda m=module: m(one), device, args.latency_calls, warmup=20)
                rates = {}
                for bs in args.raw_batches:
                    x = torch.from_numpy(seeded_images(bs, seed=bs)).to(device)
                    rates[str(bs)] = round(rows_per_s(lambda m=module, x=x: m(x), bs, device,
                                                      args.raw_seconds, warmup=5))
                self.rec.emit("raw", variant=variant, input="on device", batch1=lat,
                              rows_per_s=rates)
            diff = float((traced(one).cpu() - torch.from_numpy(self.reference)).abs().max())
            self.rec.emit("raw_trace_check", max_abs_diff_vs_eager=diff)
        del model, traced
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        self._backend_raw()

    def _export(self, model: Any, device: str) -> Any:
        """Trace the wrapper and write the model repository (resnet50 and oomtest)."""
        torch = _torch()
        args = self.args
        folder = self.repo / "resnet50"
        folder.mkdir(parents=True, exist_ok=True)
        example = torch.from_numpy(seeded_images(2)).to(device)
        with torch.inference_mode():
            traced = torch.jit.trace(model, example, check_trace=False)
        torch.jit.save(traced, str(folder / "model.pt"))
        (folder / "config.yaml").write_text(RESNET_CONFIG.format(max_batch=args.max_batch,
                                                                 device=device))
        oom = self.repo / "oomtest"
        oom.mkdir(parents=True, exist_ok=True)
        (oom / "model.py").write_text(OOM_MODEL)
        (oom / "config.yaml").write_text(OOM_CONFIG.format(device=device, oom_rows=args.oom_rows))
        self.rec.emit("repository", path=str(self.repo),
                      model_pt_mib=round((folder / "model.pt").stat().st_size / 2**20, 1))
        return torch.jit.load(str(folder / "model.pt"), map_location=device)

    def _backend_raw(self) -> None:
        """conveyor's backend without the serving stack: numpy in, copies, numpy out."""
        from batching.repository_scan import load_model_config
        from workers.backends import load_model

        args = self.args
        folder = self.repo / "resnet50"
        loaded = load_model(load_model_config(folder), folder, args.device)
        one = {"image": seeded_images(1)}
        lat = time_calls(lambda m=loaded: m.predict(one), "cpu", args.latency_calls, warmup=20)
        rates = {}
        for bs in [b for b in args.raw_batches if b <= args.max_batch]:
            batch = {"image": seeded_images(bs, seed=bs)}
            rates[str(bs)] = round(rows_per_s(lambda m=loaded, b=batch: m.predict(b), bs, "cpu",
                                              args.raw_seconds, warmup=3))
        out = loaded.predict(one)["logits"]
        diff = float(abs(out - self.reference).max()) if self.reference is not None else None
        self.rec.emit("raw", variant="conveyor backend (torchscript, numpy in/out)",
                      input="numpy on host", batch1=lat, rows_per_s=rates,
                      max_abs_diff_vs_eager=diff)
        del loaded
        torch = _torch()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    # ----- phase 3
    def start_stack(self) -> None:
        args = self.args
        if not (self.repo / "resnet50" / "model.pt").exists():
            raise RuntimeError("no model repository: the raw phase did not export the model")
        self.redis_port, api_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{api_port}"
        site = os.environ.get("PYTHONPATH", "")
        self.env = {**os.environ, "CONVEYOR_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
                    "CONVEYOR_MODEL_REPOSITORY": str(self.repo),
                    "CONVEYOR_GRPC_PORT": str(free_port()),
                    "CONVEYOR_GRPC_REUSEPORT": "1",  # uvicorn --workers N share the gRPC port
                    "CONVEYOR_WORKER_PORT": str(free_port()),
                    "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(p for p in (site, str(ROOT)) if p)}
        redis_env = dict(self.env)
        if args.redis_ld:
            redis_env["LD_LIBRARY_PATH"] = args.redis_ld
        logdir = self.work / "logs"
        logdir.mkdir(exist_ok=True)
        self.servers.append(Server("redis", [args.redis_server, "--port", str(self.redis_port),
                                             "--bind", "127.0.0.1", "--save", "",
                                             "--appendonly", "no", "--dir", str(self.work)],
                                   redis_env, logdir))
        self._wait("redis", lambda: redis_pings(self.redis_port), 15)
        self.servers.append(Server("api", [sys.executable, "-m", "uvicorn", "api.main:app",
                                           "--host", "127.0.0.1", "--port", str(api_port),
                                           "--no-access-log", "--log-level", "warning",
                                           "--workers", str(args.api_workers)],
                                   self.env, logdir))
        self.servers.append(Server("worker", [sys.executable, "-m", "celery", "-A", "workers.app",
                                              "worker", "-n", "gpucheck@%h", "--loglevel", "INFO",
                                              "--without-mingle", "--without-gossip"],
                                   self.env, logdir))
        started = time.monotonic()
        self._wait("ready", lambda: http_get(f"{self.base}/v2/health/ready")[0] == 200,
                   args.ready_timeout)
        self.rec.emit("stack_ready", seconds=round(time.monotonic() - started, 1),
                      api_workers=args.api_workers, workers=self._heartbeats("resnet50"))
        self.pool = ProcessPoolExecutor(max_workers=args.clients, mp_context=get_context("spawn"))
        list(self.pool.map(_noop, range(args.clients)))  # start them now

    def _wait(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for server in self.servers:
                server.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready after {timeout:.0f}s")
            time.sleep(0.25)

    def _redis(self) -> Any:
        import redis

        return redis.Redis(port=self.redis_port, socket_timeout=5)

    def _heartbeats(self, model: str) -> list[dict[str, Any]]:
        raw = self._redis().hgetall(f"cv:{{{model}}}:workers")
        return [json.loads(v) for v in raw.values()]

    def _stats(self, model: str) -> dict[str, int]:
        raw = self._redis().hgetall(f"cv:{{{model}}}:stats")
        return {k.decode(): int(v) for k, v in raw.items()}

    def correctness(self) -> None:
        """One binary and one JSON request of the reference image, against the raw logits."""
        import numpy as np

        url = f"{self.base}/v2/models/resnet50/infer"
        image = seeded_images(1)
        results = {}
        for name, (body, headers) in (("binary", binary_request(image)), ("json", json_request(image))):
            request = urllib.request.Request(url, body, headers)
            with urllib.request.urlopen(request, timeout=60) as response:
                logits = decode_logits(response.read(),
                                       response.headers.get("Inference-Header-Content-Length"))
            results[name] = {
                "shape": list(logits.shape),
                "max_abs_diff_vs_raw": float(np.abs(logits - self.reference).max()),
                "same_argmax": bool(logits.argmax() == self.reference.argmax()),
                "reference_absmax": float(np.abs(self.reference).max())}
        self.rec.emit("e2e_correctness", **results)

    def load_point(self, label: str, concurrency: int, body: bytes, headers: dict[str, str],
                   duration_s: float, warmup_s: float) -> None:
        assert self.pool is not None
        url = f"{self.base}/v2/models/resnet50/infer"
        procs = min(self.args.clients, concurrency)
        split = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
        if warmup_s > 0:
            list(self.pool.map(_client_run, [url] * procs, [body] * procs, [headers] * procs,
                               split, [warmup_s] * procs))
        stats0 = self._stats("resnet50")
        cpu0 = {s.name: s.cpu_s() for s in self.servers}
        util = GpuSampler(self.args.device)
        util.start()
        results = list(self.pool.map(_client_run, [url] * procs, [body] * procs,
                                     [headers] * procs, split, [duration_s] * procs))
        util.stop()
        cpu1 = {s.name: s.cpu_s() for s in self.servers}
        stats1 = self._stats("resnet50")
        latencies = [v for r in results for v in r["latencies"]]
        elapsed = max(r["elapsed_s"] for r in results)
        d = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in stats1}
        sizes = {int(k.split(":")[1]): v for k, v in d.items()
                 if k.startswith("batch:") and k.endswith(":count") and v > 0}
        rows = sum(n * c for n, c in sizes.items())
        batch_ns = {int(k.split(":")[1]): v for k, v in d.items()
                    if k.startswith("batch:") and k.endswith(":ns") and v > 0}
        self.rec.emit(
            "e2e", protocol=label, concurrency=concurrency, client_procs=procs,
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
        metrics = http_get(f"{self.base}/metrics")[1].decode(errors="replace")
        self.rec.emit("metrics_sample", note="one API process's registry (of --workers N)",
                      lines=[ln for ln in metrics.splitlines()
                             if ln.startswith(("conveyor_batch_size_sum", "conveyor_batch_size_count",
                                               "conveyor_requests_total", "conveyor_oom"))
                             and 'model="resnet50"' in ln])

    def load_point_warm(self, concurrency: int, body: bytes, headers: dict[str, str],
                        seconds: float) -> None:
        assert self.pool is not None
        url = f"{self.base}/v2/models/resnet50/infer"
        procs = min(self.args.clients, concurrency)
        split = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
        started = time.monotonic()
        results = list(self.pool.map(_client_run, [url] * procs, [body] * procs,
                                     [headers] * procs, split, [seconds] * procs))
        self.rec.emit("e2e_warmup", concurrency=concurrency, seconds=round(time.monotonic() - started, 1),
                      ok=sum(len(r["latencies"]) for r in results),
                      errors=sum(r["errors"] for r in results),
                      error_samples=[s for r in results for s in r["error_samples"]][:3])

    # ----- phase 4
    def oom_phase(self) -> None:
        import numpy as np

        args = self.args
        url = f"{self.base}/v2/models/oomtest/infer"
        before = self._stats("oomtest").get("oom_count", 0)
        waves = []
        all_ok = True
        for wave in range(args.oom_waves):
            xs = np.arange(args.oom_concurrency * 4, dtype=np.float32).reshape(-1, 1, 4) + wave
            results = asyncio.run(_oom_wave(url, xs))
            bad = [r for r in results if r is not True]
            all_ok &= not bad
            stats = self._stats("oomtest")
            waves.append({"wave": wave, "requests": len(results), "ok": len(results) - len(bad),
                          "failures": bad[:3], "oom_count": stats.get("oom_count", 0) - before})
            self.rec.emit("oom_wave", **waves[-1])
        time.sleep(2.5)  # the next heartbeat carries the loop's row cap
        beats = self._heartbeats("oomtest")
        stats = self._stats("oomtest")
        sizes = {int(k.split(":")[1]): v for k, v in stats.items()
                 if k.startswith("batch:") and k.endswith(":count")}
        caps = [b.get("row_cap") for b in beats]
        oom_count = stats.get("oom_count", 0) - before
        passed = (all_ok and bool(caps) and all(c is not None and c <= args.oom_rows for c in caps)
                  and oom_count > 0)
        self.rec.emit("oom_result", passed=passed, simulated=not args.device.startswith("cuda"),
                      limit_rows=args.oom_rows, all_requests_ok=all_ok, row_caps=caps,
                      oom_count=oom_count,
                      # rows taken per batch; a batch above the cap ran as OOM-split halves
                      taken_batch_sizes={str(k): sizes[k] for k in sorted(sizes)},
                      heartbeat={k: beats[0].get(k) for k in ("state", "batches", "rows",
                                                              "mean_batch", "row_cap",
                                                              "max_batch_size")} if beats else None,
                      dead_letter=self._redis().xlen("cv:{oomtest}:dlq"),
                      worker_alive=self._heartbeats("resnet50") != [])
        if not passed:
            raise RuntimeError(f"OOM check failed: ok={all_ok} caps={caps} oom_count={oom_count}")

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
        (args.out / "gpu.md").write_text(markdown(self.rec, args))
        return 0 if all(v == "ok" for v in self.phases.status.values()) else 1

    def shutdown(self) -> None:
        if self.pool is not None:
            procs = list((getattr(self.pool, "_processes", None) or {}).values())
            self.pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                with contextlib.suppress(Exception):
                    proc.kill()
        for server in reversed(self.servers):
            with contextlib.suppress(Exception):
                server.stop()
        with (self.args.out / "services.log").open("w") as f:
            for server in self.servers:
                f.write(server.tail(20000 if server.name == "worker" else 8000))


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


async def _oom_wave(url: str, xs: Any) -> list[Any]:
    """Send every row of ``xs`` as its own request at once; True, or what went wrong."""
    import numpy as np

    async def one(session: Any, x: Any) -> Any:
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                       "data": x.reshape(-1).tolist()}]})
        try:
            status, text = await post(session, body)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"[:200]
        if status != 200:
            return f"{status}: {text[:200]}"
        y = np.asarray(json.loads(text)["outputs"][0]["data"], dtype=np.float32)
        return True if np.allclose(y, x.reshape(-1) * 2) else f"wrong answer {y} for {x}"

    try:
        import aiohttp

        async def post(session: Any, body: str) -> tuple[int, str]:
            async with session.post(url, data=body,
                                    headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.text()

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(xs)),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            return list(await asyncio.gather(*(one(session, x) for x in xs)))
    except ImportError:
        import httpx

        async def post(session: Any, body: str) -> tuple[int, str]:  # type: ignore[misc]
            r = await session.post(url, content=body, headers={"Content-Type": "application/json"})
            return r.status_code, r.text

        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(xs)),
                                     timeout=120) as session:
            return list(await asyncio.gather(*(one(session, x) for x in xs)))


class GpuSampler:
    """nvidia-smi utilisation and memory, sampled once a second in a thread (CUDA only)."""

    def __init__(self, device: str) -> None:
        self.enabled = device.startswith("cuda")
        self.index = device.partition(":")[2] or "0"
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        if self.enabled:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(Exception):
                out = subprocess.run(["nvidia-smi", "-i", self.index,
                                      "--query-gpu=utilization.gpu,memory.used",
                                      "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                util, mem = (float(v) for v in out.strip().split(","))
                self.samples.append((util, mem))

    def summary(self) -> dict[str, float] | None:
        if not self.samples:
            return None
        return {"util_mean_pct": round(statistics.fmean(u for u, _ in self.samples), 1),
                "mem_used_mib_max": max(m for _, m in self.samples), "samples": len(self.samples)}


# --------------------------------------------------------------------------- report


def markdown(rec: Recorder, args: argparse.Namespace) -> str:
    lines: list[str] = []
    env = next(iter(rec.find("env")), {})
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
        lines += ["### Raw model: ResNet-50, uint8 224×224×3 in, "
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
        lines += ["### conveyor end to end: resnet50 (TorchScript) on "
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
    sys.exit(Check(args).run())


if __name__ == "__main__":
    main()
