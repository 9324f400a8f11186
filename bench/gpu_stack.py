"""conveyor serving a GPU model repository, and the checks run against it, shared by the
GPU benchmark (bench/gpu_bench.py) and the GPU tests (tests/gpu/).

``GpuStack`` is a redis-server, the API (``python -m api.serve``, N processes) and one Celery
inference worker, started with ``conveyor.harness``; it reads the workers' heartbeats and
statistics under the configured key prefix (``CONVEYOR_KEY_PREFIX``). ``infer_logits`` sends
images to the classifier; ``oom_waves`` drives the out-of-memory model of
bench/gpu_models.py and says whether conveyor split its batches without failing a request.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from batching.keys import Keys
from batching.settings import Settings
from bench.gpu_models import OOM_MODEL_NAME, binary_request, decode_logits, json_request
from conveyor.harness import ProcessGroup, RedisServer, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent


class GpuStack:
    """redis-server, the API and one inference worker serving ``repo``; logs in ``logdir``.

    ``redis_binary`` and ``redis_ld`` (its ``LD_LIBRARY_PATH``) name a redis-server unpacked
    where none is installed (bench/gpu_bench.sh does that on a bare GPU machine).
    """

    def __init__(self, repo: Path, logdir: Path, api_workers: int = 1,
                 redis_binary: str | None = None, redis_ld: str = "",
                 extra_env: dict[str, str] | None = None) -> None:
        self.repo = repo
        self.logdir = logdir
        self.api_workers = api_workers
        self.redis_binary = redis_binary
        self.redis_ld = redis_ld
        self.extra_env = extra_env or {}
        self.keys = Keys(Settings().key_prefix)
        self.base = ""
        self.groups: dict[str, ProcessGroup] = {}
        self._redis: RedisServer | None = None
        self._client: redis.Redis | None = None

    def start(self, ready_timeout: float) -> None:
        """Start the three and wait until the API is ready (every model has a worker)."""
        self.logdir.mkdir(parents=True, exist_ok=True)
        redis_env = dict(os.environ)
        if self.redis_ld:
            redis_env["LD_LIBRARY_PATH"] = self.redis_ld
        self._redis = RedisServer(self.logdir, binary=self.redis_binary, env=redis_env)
        assert self._redis.proc is not None
        self.groups["redis"] = self._redis.proc
        self._client = redis.Redis(port=self._redis.port, socket_timeout=5, decode_responses=True)
        api_port = free_port()
        self.base = f"http://127.0.0.1:{api_port}"
        site = os.environ.get("PYTHONPATH", "")
        env = {**os.environ, "CONVEYOR_REDIS_URL": self._redis.url,
               "CONVEYOR_MODEL_REPOSITORY": str(self.repo),
               "CONVEYOR_HTTP_PORT": str(api_port),
               "CONVEYOR_GRPC_PORT": str(free_port()),
               "CONVEYOR_API_WORKERS": str(self.api_workers),
               "CONVEYOR_WORKER_PORT": str(free_port()),
               **self.extra_env,
               "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (site, str(ROOT)) if p)}
        self.groups["api"] = ProcessGroup(
            "api", [sys.executable, "-m", "api.serve"], env, self.logdir / "api.log", cwd=ROOT)
        self.groups["worker"] = ProcessGroup(
            "worker", [sys.executable, "-m", "celery", "-A", "workers.app", "worker",
                       "-n", f"gpu-{api_port}@%h", "--loglevel", "INFO", "--without-mingle",
                       "--without-gossip"],
            env, self.logdir / "worker.log", cwd=ROOT)
        wait_until(lambda: _status(f"{self.base}/v2/health/ready") == 200, ready_timeout,
                   "the API to be ready", interval=0.25, watch=list(self.groups.values()))

    def client(self) -> redis.Redis:
        assert self._client is not None, "the stack is not started"
        return self._client

    def heartbeats(self, model: str) -> list[dict[str, Any]]:
        """The model's inference processes' heartbeats (``row_cap``, ``state``, ...)."""
        raw = self.client().hgetall(self.keys.workers(model))
        return [json.loads(v) for v in raw.values()]

    def stats(self, model: str) -> dict[str, int]:
        """The model's statistics hash: counts, times, ``batch:{rows}:count``, ``oom_count``."""
        raw = self.client().hgetall(self.keys.stats(model))
        return {str(k): int(v) for k, v in raw.items()}

    def dead_letters(self, model: str) -> int:
        return int(self.client().xlen(self.keys.dead_letter(model)))

    def tails(self, chars: int = 8000) -> str:
        return "".join(group.tail(chars) for group in self.groups.values())

    def stop(self) -> None:
        """Stop the API and the worker, then Redis; safe to call more than once."""
        for name in ("api", "worker"):
            if name in self.groups:
                self.groups[name].stop()
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._redis is not None:
            self._redis.stop()
            self._redis = None


def _status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        return int(response.status)


def infer_logits(base: str, model: str, images: Any, protocol: str) -> Any:
    """The logits ``model`` answers for ``images``, sent as binary tensors or as JSON."""
    body, headers = binary_request(images) if protocol == "binary" else json_request(images)
    request = urllib.request.Request(f"{base}/v2/models/{model}/infer", body, headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        return decode_logits(response.read(), response.headers.get("Inference-Header-Content-Length"))


@dataclass
class OomResult:
    """What ``oom_waves`` saw: every request right, the learned row cap, the OOM count."""

    limit_rows: int
    simulated: bool
    waves: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    row_caps: list[int | None] = field(default_factory=list)
    oom_count: int = 0
    taken_batch_sizes: dict[str, int] = field(default_factory=dict)
    heartbeat: dict[str, Any] | None = None
    dead_letter: int = 0

    @property
    def passed(self) -> bool:
        """Every request answered right, every process's row cap at or below the limit, and
        at least one out-of-memory error (else nothing was tested)."""
        return (not self.failures and bool(self.row_caps) and self.oom_count > 0
                and all(c is not None and c <= self.limit_rows for c in self.row_caps))


def oom_waves(stack: GpuStack, waves: int, concurrency: int, limit_rows: int,
              simulated: bool) -> OomResult:
    """Waves of ``concurrency`` one-row requests at once to the out-of-memory model, whose
    batches of more than ``limit_rows`` rows run out of device memory."""
    import numpy as np

    url = f"{stack.base}/v2/models/{OOM_MODEL_NAME}/infer"
    before = stack.stats(OOM_MODEL_NAME).get("oom_count", 0)
    result = OomResult(limit_rows, simulated)
    for wave in range(waves):
        xs = np.arange(concurrency * 4, dtype=np.float32).reshape(-1, 1, 4) + wave
        bad = asyncio.run(_oom_wave(url, xs))
        result.failures += bad
        oom_count = stack.stats(OOM_MODEL_NAME).get("oom_count", 0) - before
        result.waves.append({"wave": wave, "requests": len(xs), "ok": len(xs) - len(bad),
                             "failures": bad[:3], "oom_count": oom_count})
    time.sleep(2.5)  # the next heartbeat carries the loop's row cap
    beats = stack.heartbeats(OOM_MODEL_NAME)
    stats = stack.stats(OOM_MODEL_NAME)
    sizes = {int(k.split(":")[1]): v for k, v in stats.items()
             if k.startswith("batch:") and k.endswith(":count")}
    result.row_caps = [b.get("row_cap") for b in beats]
    result.oom_count = stats.get("oom_count", 0) - before
    # rows taken per batch; a batch above the cap ran as OOM-split halves
    result.taken_batch_sizes = {str(k): sizes[k] for k in sorted(sizes)}
    result.heartbeat = ({k: beats[0].get(k) for k in ("state", "batches", "rows", "mean_batch",
                                                       "row_cap", "max_batch_size")}
                        if beats else None)
    result.dead_letter = stack.dead_letters(OOM_MODEL_NAME)
    return result


async def _oom_wave(url: str, xs: Any) -> list[str]:
    """Send every row of ``xs`` as its own request at once; what went wrong, if anything."""
    import numpy as np

    async def one(client: httpx.AsyncClient, x: Any) -> str | None:
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                       "data": x.reshape(-1).tolist()}]})
        try:
            response = await client.post(url, content=body,
                                         headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"[:200]
        if response.status_code != 200:
            return f"{response.status_code}: {response.text[:200]}"
        y = np.asarray(response.json()["outputs"][0]["data"], dtype=np.float32)
        return None if np.allclose(y, x.reshape(-1) * 2) else f"wrong answer {y} for {x}"

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(xs)),
                                 timeout=120) as client:
        answers = await asyncio.gather(*(one(client, x) for x in xs))
    return [a for a in answers if a is not None]
