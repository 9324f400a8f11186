"""``conveyor run``: Redis (when none answers), the API, an inference worker, a job worker
and Flower.

For a laptop or a single box; production runs each process on its own (Procfile,
docker-compose.yml, deploy/). Every listener binds ``CONVEYOR_HOST`` (``--host``;
127.0.0.1 by default), and binding beyond loopback needs API keys or an explicit
``CONVEYOR_ALLOW_UNAUTHENTICATED=1``.

Stopping: SIGTERM, SIGINT or SIGHUP (or any child exiting) sends SIGTERM to every child
at once, the API first, so it stops accepting; Redis, when this command started it, goes
once the others are gone. Whatever is left when ``STOP_DEADLINE_S`` has passed is killed
with its whole process group (an inference worker's model processes too). Further signals
during the stop change nothing. Children die with this command even when it is killed
outright (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from batching.exposure import is_loopback, unsafe_binding
from batching.redis_topology import parse_topology
from batching.settings import Settings
from batching.urls import mask_url
from conveyor.celery_client import celery_url
from conveyor.harness import ProcessGroup, redis_answers, redis_argv, wait_until

STOP_DEADLINE_S = 8.0
"""One deadline for the whole stop, inside Docker's and Kubernetes' default grace (10 s
and 30 s)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
POLL_S = 0.05
FLOWER_AUTH_ENV = ("FLOWER_BASIC_AUTH", "FLOWER_AUTH")
"""Flower's own login settings (basic auth ``user:pass[,user:pass]``; OAuth), which Flower
reads from the environment itself."""


def start(name: str, argv: list[str], env: Mapping[str, str] | None = None) -> ProcessGroup:
    """Start ``argv`` in its own session (a terminal's Ctrl-C reaches only this launcher,
    which stops everything), to be SIGKILLed by the kernel if this process dies."""
    return ProcessGroup(name, argv, env, dies_with_parent=True)


class StopRequest:
    """Signal handler for ``STOP_SIGNALS``: records the first; later ones change nothing
    (the stop is bounded anyway), so no second signal can interrupt it."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, _frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self)


def redis_data_folder(port: int) -> Path:
    """Where the redis-server this command starts keeps its append-only file:
    ``.run/redis-<port>/`` under the working directory."""
    return Path(".run") / f"redis-{port}"


def start_redis(url: str, data: Path | None = None) -> ProcessGroup:
    """A redis-server on loopback, for a local ``url`` that nothing answers at, with an
    append-only file synced every second in ``data`` (:func:`redis_data_folder` by
    default): a restart loses at most the last second of requests and jobs."""
    parsed = urlparse(url)
    if not is_loopback(parsed.hostname or ""):
        sys.exit(f"nothing answers at {mask_url(url)}, and it is not local: "
                 "start Redis there first")
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed: apt-get install redis-server")
    port = parsed.port or 6379
    folder = data if data is not None else redis_data_folder(port)
    folder.mkdir(parents=True, exist_ok=True)
    child = start("redis", redis_argv(binary, port, folder.resolve(), durable=True))
    try:
        wait_until(lambda: redis_answers(url), 10, "redis-server", interval=0.1, watch=[child])
    except (TimeoutError, ChildProcessError):
        child.kill_group()
        sys.exit(f"redis-server did not start at {mask_url(url)}")
    return child


def flower_binding(settings: Settings, env: Mapping[str, str]) -> tuple[str, str]:
    """The address Flower binds and how it lets people in, for the start-up message.

    Beyond loopback Flower needs its own login (``FLOWER_BASIC_AUTH`` or OAuth) unless
    ``allow_unauthenticated``; without one it stays on 127.0.0.1.
    """
    if any(env.get(name) for name in FLOWER_AUTH_ENV):
        return settings.host, "login: Flower's own (FLOWER_BASIC_AUTH or OAuth)"
    if is_loopback(settings.host):
        return settings.host, "no login: this host only"
    if settings.allow_unauthenticated:
        return settings.host, "no login, open to the network: CONVEYOR_ALLOW_UNAUTHENTICATED"
    return "127.0.0.1", (f"no login, so this host only: set FLOWER_BASIC_AUTH=user:pass to "
                         f"serve it on {settings.host}")


def commands(settings: Settings, flower_host: str) -> dict[str, list[str]]:
    """What runs, in the order it starts and is told to stop: the API first."""
    py = sys.executable
    return {
        "api": [py, "-m", "api.serve"],
        "worker": [py, "-m", "celery", "-A", "workers.app", "worker", "-n", "conveyor@%h",
                   "--loglevel", "INFO"],
        "jobs": [py, "-m", "celery", "-A", "workers.app", "worker", "-Q", "cv.jobs",
                 "--no-inference", "-P", "threads", "-c", "4", "-n", "jobs@%h",
                 "--loglevel", "INFO"],
        "flower": [py, "-m", "celery", "-A", "workers.app", "flower",
                   f"--address={flower_host}", f"--port={settings.flower_port}"],
    }


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def banner(settings: Settings, flower_host: str, flower_login: str) -> str:
    """Where each listener is bound, and who may use it."""
    scheme = "https" if settings.tls_cert_file is not None else "http"
    http = _address(settings.host, settings.http_port)
    probe = (f"http://{_address(settings.host, settings.worker_port)}/ready"
             if settings.worker_port else "off (CONVEYOR_WORKER_PORT=0)")
    lines = [
        f"conveyor is starting; models from {settings.model_repository}",
        f"  HTTP API      {scheme}://{http}/v2  (ready: /v2/health/ready, metrics: /metrics, "
        "jobs: /v1/jobs)",
        f"  gRPC          {_address(settings.host, settings.grpc_port)}"
        f"{'  (TLS)' if settings.tls_cert_file is not None else ''}",
        f"  API processes {settings.api_processes()} (CONVEYOR_API_WORKERS; several share both ports)",
        f"  worker probe  {probe}",
        f"  Flower        http://{_address(flower_host, settings.flower_port)}  "
        f"({flower_login})",
    ]
    if settings.api_keys_file is not None:
        lines.append(f"API keys from {settings.api_keys_file}.")
    elif is_loopback(settings.host):
        lines.append(f"Loopback only ({settings.host}): no CONVEYOR_API_KEYS_FILE is set, so "
                     "nothing is authenticated and no other machine can connect.")
    else:
        lines.append(f"No authentication (CONVEYOR_ALLOW_UNAUTHENTICATED) on {settings.host}: "
                     "anyone who reaches it may infer, submit jobs and control models.")
    lines.append("Ctrl-C stops everything.")
    return "\n".join(lines)


def run(host: str | None = None) -> int:
    settings = Settings() if host is None else Settings(host=host)
    refusal = unsafe_binding(settings)
    if refusal is not None:
        print(f"conveyor run: {refusal}", file=sys.stderr)
        return 2
    try:
        celery_url(settings.celery_broker())
    except ValueError as exc:
        print(f"conveyor run: {exc}", file=sys.stderr)
        return 2
    stop = StopRequest()
    stop.install()
    own_redis: list[ProcessGroup] = []
    if parse_topology(settings.redis_url).kind != "single" or redis_answers(settings.redis_url):
        print(f"using Redis at {mask_url(settings.redis_url)}")
    else:
        own_redis.append(start_redis(settings.redis_url))
        print(f"started redis-server at {mask_url(settings.redis_url)}")
    flower_host, flower_login = flower_binding(settings, os.environ)
    # Children read the host from the environment: API (HTTP, gRPC) and worker probe.
    env = {**os.environ, "CONVEYOR_HOST": settings.host}
    children = [start(name, argv, env) for name, argv in commands(settings, flower_host).items()]
    print(f"\n{banner(settings, flower_host, flower_login)}\n", flush=True)
    code = watch(children + own_redis, stop)
    stop_all(children, own_redis)
    return code


def watch(children: list[ProcessGroup], stop: StopRequest) -> int:
    """Wait for a stop signal (0) or a child's exit (1)."""
    while stop.signum is None:
        exited = [c for c in children if not c.alive()]
        if exited:
            names = ", ".join(f"{c.name} (code {c.popen.returncode})" for c in exited)
            _say(f"{names} exited; stopping the rest")
            return 1
        time.sleep(POLL_S)
    _say(f"{signal.Signals(stop.signum).name}: stopping everything "
         f"(at most {STOP_DEADLINE_S:.0f}s)")
    return 0


def stop_all(children: list[ProcessGroup], own_redis: list[ProcessGroup],
             deadline_s: float = STOP_DEADLINE_S) -> None:
    """SIGTERM to every child at once (in list order, the API first), Redis once they are
    gone; after one overall deadline, SIGKILL to every child's process group."""
    deadline = time.monotonic() + deadline_s
    for child in children:
        child.terminate()
    _wait(children, deadline)
    for child in own_redis:
        child.terminate()
    _wait(own_redis, deadline)
    late = [c.name for c in children + own_redis if c.alive()]
    if late:
        _say(f"{', '.join(late)} still running after {deadline_s:.0f}s: killed")
    for child in children + own_redis:
        child.kill_group()


def _say(text: str) -> None:
    """A message on stderr that cannot break the stop: the terminal or the pipe reading
    it (``make run | tee``) may be gone by now."""
    with contextlib.suppress(OSError):
        print(text, file=sys.stderr, flush=True)


def _wait(children: list[ProcessGroup], deadline: float) -> None:
    while any(c.alive() for c in children) and time.monotonic() < deadline:
        time.sleep(POLL_S)
