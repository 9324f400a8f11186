"""Starting, watching and stopping local processes: free ports, Redis PING, process groups
and a throwaway redis-server.

One home for what ``conveyor run``, the benchmarks (``bench/``) and the tests
(``tests/procs.py``) all do, so that they start, wait for and stop processes the same way.
Every process starts in a session of its own, so one ``killpg`` reaches everything it
started (a Celery worker's model processes, uvicorn's workers).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from urllib.parse import urlparse

from batching.lifetime import die_with_parent

_TICKS = os.sysconf("SC_CLK_TCK")
STOP_TIMEOUT_S = 15.0
"""How long ``ProcessGroup.stop`` lets a process shut down after SIGTERM."""


def free_port() -> int:
    """A TCP port nothing listens on at this moment (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_pings(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a Redis answers PING at ``host:port``; ``-NOAUTH`` (a password is needed)
    counts as an answer: it is a Redis, only a locked one."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith((b"+PONG", b"-NOAUTH"))


def redis_answers(url: str) -> bool:
    """Whether a Redis answers PING at the host and port of ``url``."""
    parsed = urlparse(url)
    return redis_pings(parsed.port or 6379, parsed.hostname or "127.0.0.1")


class ProcessGroup:
    """A process started as the leader of its own session and process group.

    Its output goes to ``log`` (or, without one, to this process's own stdout and stderr).
    With ``dies_with_parent`` the kernel SIGKILLs it when this process dies, however it dies.
    """

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
                 log: Path | None = None, cwd: Path | None = None,
                 dies_with_parent: bool = False) -> None:
        self.name = name
        self.log_path = log
        preexec = (functools.partial(die_with_parent, signal.SIGKILL, os.getpid())
                   if dies_with_parent else None)
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(log.open("wb")) if log is not None else None
            # The child holds its own copy of the log's descriptor; ours closes at once.
            self.popen = subprocess.Popen(list(argv), env=env, cwd=cwd, stdout=out,
                                          stderr=subprocess.STDOUT if out else None,
                                          start_new_session=True, preexec_fn=preexec)

    @property
    def pid(self) -> int:
        """The leader's pid, which is also the process group's id."""
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the leader, if it still runs."""
        if self.alive():
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM to the leader, which stops what it started in its own way."""
        self.signal(signal.SIGTERM)

    def kill_group(self) -> None:
        """SIGKILL the process group: the leader and anything it started that is left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, ``timeout`` seconds to finish, then SIGKILL to whatever is left of the group."""
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        self.kill_group()

    def log(self) -> str:
        """What the process wrote to its log so far."""
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"

    def tail(self, chars: int = 3000) -> str:
        """The end of the log, headed with the name, pid and exit code: for error messages."""
        return (f"===== {self.name} (pid {self.pid}, exit code {self.popen.poll()}) =====\n"
                f"{self.log()[-chars:]}\n")


def wait_until(ready: Callable[[], bool], timeout: float, what: str, *, interval: float = 0.05,
               watch: Sequence[ProcessGroup] = (),
               retry_on: tuple[type[Exception], ...] = (OSError,)) -> None:
    """Poll ``ready`` until it holds; a ``retry_on`` error it raises counts as not yet.

    Raises ``TimeoutError`` after ``timeout`` seconds, or ``ChildProcessError`` as soon as
    one of the ``watch`` processes has exited (it will not get ready any more); both name
    ``what`` and carry the log tails of the ``watch`` processes.
    """
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(*retry_on):
            if ready():
                return
        dead = [group for group in watch if not group.alive()]
        if dead:
            names = ", ".join(group.name for group in dead)
            raise ChildProcessError(f"{names} exited before {what}\n{_tails(watch)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{_tails(watch)}")
        time.sleep(interval)


def _tails(groups: Sequence[ProcessGroup]) -> str:
    return "".join(group.tail() for group in groups)


def group_cpu_s(groups: Sequence[ProcessGroup],
                child_labels: Mapping[str, str] | None = None) -> dict[str, float]:
    """utime+stime (s) of every live process of the groups, summed per group name (or, for
    the processes other than a group's leader, per its ``child_labels`` entry if it has one)."""
    by_pgid = {group.pid: group for group in groups}
    labels = child_labels or {}
    totals: dict[str, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):
            stat = Path(entry.path, "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # from the 3rd field (state) on
            group = by_pgid.get(int(fields[2]))  # pgrp
            if group is not None:
                label = (group.name if int(entry.name) == group.pid
                         else labels.get(group.name, group.name))
                totals[label] = totals.get(label, 0.0) + (int(fields[11]) + int(fields[12])) / _TICKS
    return totals


def redis_argv(binary: str, port: int, workdir: Path | None = None,
               durable: bool = False) -> list[str]:
    """redis-server on loopback (``--dir``: where it may write at all), without
    persistence, or ``durable``: with an append-only file synced every second, so a
    restart loses at most the last second of writes."""
    appendonly = ["--appendonly", "yes", "--appendfsync", "everysec"] if durable else [
        "--appendonly", "no"]
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *appendonly]
    return argv if workdir is None else [*argv, "--dir", str(workdir)]


class RedisServer:
    """A throwaway redis-server on a free loopback port, started at once; its log and its
    working folder are ``workdir``. ``stop`` kills it outright (it keeps nothing), and
    ``start`` brings an empty one back on the same port, as after a crash."""

    def __init__(self, workdir: Path, *args: str, binary: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        found = binary or shutil.which("redis-server")
        if found is None:
            raise RuntimeError("redis-server is not on PATH: install it (apt-get install redis-server)")
        self.binary = found
        self.port = free_port()
        self.workdir = workdir
        self.args = list(args)
        self.env = dict(env if env is not None else os.environ)
        self.proc: ProcessGroup | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = self.workdir / f"redis-{self.port}-{time.monotonic_ns()}.log"
        self.proc = ProcessGroup("redis", [*redis_argv(self.binary, self.port, self.workdir),
                                           *self.args], self.env, log)
        try:
            wait_until(lambda: redis_pings(self.port), 10, "redis-server to answer",
                       watch=[self.proc])
        except OSError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill_group()
            self.proc = None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, _type: type[BaseException] | None, _value: BaseException | None,
                 _traceback: TracebackType | None) -> None:
        self.stop()
