"""conveyor's processes on the hosts of tests/multihost/netns.py: redis-server on the Redis
host, ``python -m api.serve`` on each API host, a Celery inference worker on each worker
host, and what the test reads of them in Redis.

Each service listens on its own host's address (the API: ``CONVEYOR_HOST`` with
``CONVEYOR_ALLOW_UNAUTHENTICATED=1``, as a deployment without API keys would), so every
port is the usual one. The test itself reaches Redis through a unix socket in its own
folder, not over the network: the machine it runs on has no address on the switch.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from batching.envelope import FIELD, Request
from batching.keys import GROUP, Keys
from batching.repository_scan import as_text
from batching.tensor_transport import is_remote
from tests.multihost.netns import Host
from tests.procs import ROOT, Proc, wait_for

MODEL = "echo"
LEVELS = 3
"""The echo model's priority levels: its streams are q:1 to q:3."""
REDIS_PORT = 6379
API_PORT = 8000
LARGE = 16
"""``CONVEYOR_TENSOR_ARENA_MIN_BYTES`` of the APIs: the echo model's input (4 FP32) counts
as large, so every request's input is fetched by the worker from its API process's bytes
endpoint, as a large input between hosts is (docs/data-path.md)."""
STALE_S = 3.0
"""``CONVEYOR_HEARTBEAT_STALE_S``: a worker silent this long is dead to the others, which
then claim its pending entries (docs/data-path.md, section 8)."""


def group_pids(pgid: int) -> set[int]:
    """The processes of the process group ``pgid``: a worker's Celery process and its
    inference processes."""
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
                found.add(int(entry.name))
    return found


@dataclass
class Services:
    """The processes started on the hosts, stopped together by ``stop``."""

    workdir: Path
    prefix: str
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys = Keys(self.prefix)
        self.socket = self.workdir / "redis.sock"
        self.redis_url = ""

    def _start(self, name: str, host: Host, argv: list[str], env: dict[str, str],
               own_shm: bool = False) -> Proc:
        proc = Proc(name, host.argv(argv, own_shm=own_shm), env, self.workdir)
        self.procs.append(proc)
        return proc

    def start_redis(self, host: Host) -> Proc:
        """redis-server on ``host``'s address (``protected-mode no``: no password on this
        private switch) and on the test's unix socket, without persistence."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH: install it (apt-get install redis-server)")
        proc = self._start("redis", host, [
            binary, "--bind", host.address, "--port", str(REDIS_PORT), "--protected-mode", "no",
            "--unixsocket", str(self.socket), "--unixsocketperm", "700", "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir)], dict(os.environ))
        self.redis_url = f"redis://{host.address}:{REDIS_PORT}/0"
        wait_for(lambda: self.client().ping(), 20, f"redis-server\n{proc.tail()}")
        return proc

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "CONVEYOR_REDIS_URL": self.redis_url,
                "CONVEYOR_MODEL_REPOSITORY": str(ROOT / "tests" / "models"),
                "CONVEYOR_MODELS": MODEL, "CONVEYOR_KEY_PREFIX": self.prefix,
                "CONVEYOR_HEARTBEAT_STALE_S": str(STALE_S), "PYTHONUNBUFFERED": "1", **extra}

    def start_api(self, host: Host) -> tuple[Proc, str]:
        """One API process on ``host``'s address; its URL."""
        proc = self._start(host.name, host, [sys.executable, "-m", "api.serve"], self.env(
            CONVEYOR_HOST=host.address, CONVEYOR_ALLOW_UNAUTHENTICATED="1",
            CONVEYOR_HTTP_PORT=str(API_PORT), CONVEYOR_GRPC_PORT=str(API_PORT + 1),
            CONVEYOR_API_WORKERS="1", CONVEYOR_TENSOR_ARENA_MIN_BYTES=str(LARGE)), own_shm=True)
        return proc, f"http://{host.address}:{API_PORT}"

    def start_worker(self, host: Host) -> Proc:
        """A Celery inference worker (its probe on the host's loopback), serving echo."""
        return self._start(host.name, host, [
            sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-n",
            f"{host.name}@%h", "--loglevel", "INFO", "--without-mingle", "--without-gossip"],
            self.env(CONVEYOR_HOST="127.0.0.1", CONVEYOR_WORKER_PORT="8002"), own_shm=True)

    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket), socket_timeout=10)

    def beats(self, worker: Proc) -> dict[str, dict[str, Any]]:
        """The heartbeats of ``worker``'s inference processes, by consumer name."""
        pids = group_pids(worker.pid)
        with self.client() as client:
            raw = cast(dict[bytes, bytes], client.hgetall(self.keys.workers(MODEL)))
        beats = {k.decode(): json.loads(v) for k, v in raw.items() if not k.endswith(b":slot")}
        return {name: beat for name, beat in beats.items() if beat.get("pid") in pids}

    def ready(self, worker: Proc) -> bool:
        return any(beat.get("state") == "ready" for beat in self.beats(worker).values())

    def rows(self, worker: Proc) -> tuple[float, int]:
        """The rows ``worker``'s inference processes ran, as their heartbeats last said,
        and when the oldest of those beats was (``time.time()``)."""
        beats = self.beats(worker).values()
        return (min((float(b["ts"]) for b in beats), default=0.0),
                sum(int(b.get("rows", 0)) for b in beats))

    def pending(self, consumers: set[str]) -> int:
        """Entries read by ``consumers`` and not yet answered, over the model's streams."""
        total = 0
        with self.client() as client:
            for stream in self.keys.queues(MODEL, LEVELS):
                if not client.exists(stream):
                    continue
                summary = client.xpending(stream, GROUP)
                total += sum(int(c["pending"]) for c in summary["consumers"]
                             if c["name"].decode() in consumers)
        return total

    def fetched(self) -> int:
        """Entries waiting in the model's streams whose input is a reference to its API
        process's bytes endpoint (batching/tensor_transport.py)."""
        found = 0
        with self.client() as client:
            for stream in self.keys.queues(MODEL, LEVELS):
                entries = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(stream))
                found += sum(1 for _, fields in entries
                             if any(t.ref is not None and is_remote(t.ref)
                                    for t in Request.decode(fields[FIELD]).inputs))
        return found

    def stats(self) -> dict[str, int]:
        with self.client() as client:
            raw = cast(dict[bytes, bytes], client.hgetall(self.keys.stats(MODEL)))
        return {k.decode(): int(v) for k, v in raw.items() if v.isdigit()}

    def rows_waiting(self) -> int:
        with self.client() as client:
            return int(cast(bytes | None, client.get(self.keys.rows_waiting(MODEL))) or 0)

    def logs(self) -> str:
        return "".join(proc.tail(1500) for proc in self.procs)

    def groups(self) -> str:
        """The model's consumers as Redis holds them (pending, idle) and the age of each
        heartbeat: what a failed wait on a reclaim needs to be read."""
        now = time.time()
        try:
            with self.client() as client:
                lines = [f"{stream}: " + ", ".join(
                    f"{as_text(c['name'])} pending {c['pending']} idle {c['idle']} ms"
                    for c in cast(list[dict[str, Any]], client.xinfo_consumers(stream, GROUP)))
                    for stream in self.keys.queues(MODEL, LEVELS) if client.exists(stream)]
                beats = cast(dict[bytes, bytes], client.hgetall(self.keys.workers(MODEL)))
        except redis.RedisError as exc:
            return f"(Redis could not be read: {exc})"
        lines += [f"beat {k.decode()}: {now - float(json.loads(v).get('ts', 0)):.1f} s old"
                  for k, v in beats.items()]
        return "\n".join(lines)

    def stop(self) -> None:
        """SIGKILL every process group: nothing here needs a clean stop."""
        for proc in self.procs:
            proc.kill_group()
