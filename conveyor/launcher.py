"""``conveyor run``: Redis (when none answers), the API, an inference worker, a job worker
and Flower.

For a laptop or a single box; production runs each process on its own (Procfile,
docker-compose.yml, deploy/). Ctrl-C stops everything this command started.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

from batching.settings import Settings


def redis_answers(url: str) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379),
                                      timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")


def start_redis(url: str) -> subprocess.Popen[bytes]:
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"nothing answers at {url}, and it is not local: start Redis there first")
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed: apt-get install redis-server")
    proc = subprocess.Popen([binary, "--port", str(parsed.port or 6379), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 10
    while not redis_answers(url):
        if time.monotonic() > deadline or proc.poll() is not None:
            sys.exit(f"redis-server did not start at {url}")
        time.sleep(0.1)
    return proc


def run(host: str = "0.0.0.0") -> int:
    settings = Settings()
    py = sys.executable
    started: list[tuple[str, subprocess.Popen[bytes]]] = []
    if redis_answers(settings.redis_url):
        print(f"using Redis at {settings.redis_url}")
    else:
        started.append(("redis", start_redis(settings.redis_url)))
        print(f"started redis-server at {settings.redis_url}")
    commands = {
        "api": [py, "-m", "uvicorn", "api.main:app", "--host", host,
                "--port", str(settings.http_port), "--no-access-log"],
        "worker": [py, "-m", "celery", "-A", "workers.app", "worker", "-n", "conveyor@%h",
                   "--loglevel", "INFO"],
        "jobs": [py, "-m", "celery", "-A", "workers.app", "worker", "-Q", "cv.jobs",
                 "--no-inference", "-P", "threads", "-c", "4", "-n", "jobs@%h",
                 "--loglevel", "INFO"],
        "flower": [py, "-m", "celery", "-A", "workers.app", "flower",
                   f"--port={settings.flower_port}"],
    }
    for name, argv in commands.items():
        # Own sessions: Ctrl-C reaches only this launcher, which stops them in order.
        started.append((name, subprocess.Popen(argv, start_new_session=True)))
    print(f"\nconveyor is starting; models from {settings.model_repository}\n"
          f"  HTTP API  http://127.0.0.1:{settings.http_port}/v2  (ready: /v2/health/ready)\n"
          f"  metrics   http://127.0.0.1:{settings.http_port}/metrics\n"
          f"  jobs      http://127.0.0.1:{settings.http_port}/v1/jobs  (conveyor jobs --help)\n"
          f"  Flower    http://127.0.0.1:{settings.flower_port}\n"
          "Ctrl-C stops everything.\n", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while all(proc.poll() is None for _, proc in started):
            time.sleep(0.5)
        failed = [name for name, proc in started if proc.poll() is not None]
        print(f"{', '.join(failed)} exited; stopping the rest", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 0
    stop_all(started)
    return code


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def stop_all(started: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    """Stop in reverse order: the worker finishes its batch before Redis goes."""
    for _, proc in reversed(started):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
