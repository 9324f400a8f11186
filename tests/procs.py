"""Real processes for integration tests: redis-server, the API (``python -m api.serve``) and
Celery workers."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], bool], timeout: float, what: str,
             interval: float = 0.05) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (OSError, httpx.HTTPError):
            pass
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class Proc:
    """A child process whose output goes to a log file, shown when a test needs it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name = name
        self.probe_port = 0
        self.log_path = logdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.popen = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL the whole process group if it lingers."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(5)
        self._kill_group()
        self._log.close()

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)


class RedisServer:
    def __init__(self, logdir: Path, *args: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH: install it (apt-get install redis-server)")
        self.binary = binary
        self.port = free_port()
        self.logdir = logdir
        self.args = list(args)
        self.proc: Proc | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.logdir), *self.args]
        self.proc = Proc(f"redis-{self.port}-{time.monotonic_ns()}", argv, dict(os.environ),
                         self.logdir)
        wait_for(self._pings, 10, "redis-server to answer")

    def _pings(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.signal(signal.SIGKILL)
            self.proc.stop()
            self.proc = None


def service_env(redis_url: str, repository: Path, prefix: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "CONVEYOR_REDIS_URL": redis_url,
        "CONVEYOR_MODEL_REPOSITORY": str(repository),
        "CONVEYOR_KEY_PREFIX": prefix,
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra)
    return env


def start_api(env: dict[str, str], logdir: Path, name: str = "api") -> tuple[Proc, str]:
    """The API as deployed (``python -m api.serve``: HTTP guards, no access log) on loopback."""
    port = free_port()
    # Each API also serves gRPC; unless the test chose its port, give it a free one.
    env = {"CONVEYOR_GRPC_PORT": str(free_port()), **env, "CONVEYOR_HOST": "127.0.0.1",
           "CONVEYOR_HTTP_PORT": str(port)}
    proc = Proc(f"{name}-{port}", [sys.executable, "-m", "api.serve"], env, logdir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/v2/health/live").status_code == 200, 30,
                 f"API {name} to go live")
    except AssertionError:
        raise AssertionError(proc.log()) from None
    return proc, url


def start_worker(env: dict[str, str], logdir: Path, name: str = "worker") -> Proc:
    """A Celery inference worker; its probe port is in the returned Proc's ``probe_port``."""
    port = free_port()
    node = f"{name}-{port}@%h"
    env = {**env, "CONVEYOR_WORKER_PORT": str(port)}
    proc = Proc(node.split("@")[0], [sys.executable, "-m", "celery", "-A", "workers.app",
                                     "worker", "-n", node, "--loglevel", "INFO",
                                     "--without-mingle", "--without-gossip"], env, logdir)
    proc.probe_port = port
    return proc
