"""Real processes for integration tests: redis-server, the API (``python -m api.serve``) and
Celery workers, on the processes of ``conveyor.harness`` (``free_port`` and ``RedisServer``
are its own, imported from here by the tests)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from conveyor.harness import ProcessGroup, RedisServer, free_port, wait_until

__all__ = ["ROOT", "Proc", "RedisServer", "free_port", "service_env", "start_api", "start_worker",
           "wait_for"]

ROOT = Path(__file__).resolve().parent.parent


def wait_for(condition: Callable[[], bool], timeout: float, what: str,
             interval: float = 0.05) -> None:
    """Poll ``condition`` until it holds; fail the test naming ``what`` after ``timeout`` seconds."""
    try:
        wait_until(condition, timeout, what, interval=interval, retry_on=(OSError, httpx.HTTPError))
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}") from None


class Proc(ProcessGroup):
    """A child process whose output goes to ``logdir/{name}.log``, shown when a test needs it;
    ``probe_port`` is a worker's probe port (``start_worker``)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: Path) -> None:
        super().__init__(name, argv, env, logdir / f"{name}.log", cwd=ROOT)
        self.probe_port = 0


def service_env(redis_url: str, repository: Path, prefix: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "CONVEYOR_REDIS_URL": redis_url,
        "CONVEYOR_MODEL_REPOSITORY": str(repository),
        "CONVEYOR_KEY_PREFIX": prefix,
        "PYTHONUNBUFFERED": "1",
        "CONVEYOR_API_WORKERS": "1",  # one API process unless a test asks for more
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
