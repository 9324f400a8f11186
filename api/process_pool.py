"""Several API processes on one port (``CONVEYOR_API_WORKERS``), and their supervisor.

The parent binds the HTTP socket and forks one child per process before anything of the
application exists (no Redis client, event loop or gRPC thread), so each child builds its
own: its own reply list in Redis, its own gRPC server on the shared port (SO_REUSEPORT),
and it serves HTTP on the inherited socket, whose connections the kernel spreads over the
processes. The parent only supervises:

- a child that dies (an OOM kill, a crash) is started again after a back-off that doubles
  while children keep dying and returns to its start once one has lived ``STABLE_S``; only
  that child's in-flight requests were lost, the others serve on;
- a child that fails to start (``STARTUP_FAILURE``: a port in use, a bad certificate)
  stops them all, since every child would fail the same way;
- SIGTERM or SIGINT goes to every child, which drains its requests as a lone API process
  does; after ``STOP_GRACE_S`` the stragglers are killed. Children die with the parent
  (``PR_SET_PDEATHSIG``) should it be killed outright.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from types import FrameType

from prometheus_client.multiprocess import mark_process_dead
from uvicorn.config import STARTUP_FAILURE

from batching.backoff import Backoff
from batching.lifetime import die_with_parent

log = logging.getLogger("conveyor.api")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RESTART_START_S = 0.5
RESTART_MAX_S = 30.0
STABLE_S = 60.0
"""A child that lived this long resets the restart back-off."""
STOP_GRACE_S = 30.0
POLL_S = 0.1


class ProcessPool:
    """``count`` children, each running ``serve()`` (its exit status), kept at that count."""

    def __init__(self, count: int, serve: Callable[[], int]) -> None:
        self.count = count
        self._serve = serve
        self._children: dict[int, float] = {}
        """pid -> when it started (monotonic)."""
        self._stop: int | None = None
        self._backoff = Backoff(RESTART_START_S, RESTART_MAX_S)
        self._restart_at: list[float] = []

    def run(self) -> int:
        """Supervise until a stop signal (0) or a child's failed start (its status)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        for _ in range(self.count):
            self._spawn()
        code = 0
        while self._stop is None:
            code = self._reap()
            if code:
                break
            now = time.monotonic()
            while self._restart_at and self._restart_at[0] <= now and self._stop is None:
                self._restart_at.pop(0)
                self._spawn()
            time.sleep(POLL_S)
        self._stop_children()
        return code

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._stop = signum

    def _spawn(self) -> None:
        parent = os.getpid()
        # A stop signal between the fork and the child's own handlers would run the
        # supervisor's handler in the child and be lost: hold them until both are set.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        pid = os.fork()
        if pid == 0:  # the child: never returns into the supervisor's loop
            status = 1
            try:
                for sig in STOP_SIGNALS:
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
                die_with_parent(signal.SIGTERM, parent)
                status = self._serve()
            except BaseException:
                log.exception("API process %d failed", os.getpid())
            finally:
                os._exit(status)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        self._children[pid] = time.monotonic()
        log.info("API process %d started (%d of %d)", pid, len(self._children), self.count)

    def _reap(self) -> int:
        """Collect exited children and schedule their restarts; a failed start's status, or 0."""
        while self._children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return 0
            started = self._children.pop(pid, None)
            if started is None:
                continue
            _forget_metrics(pid)
            code = os.waitstatus_to_exitcode(status)
            if code == STARTUP_FAILURE:
                log.error("API process %d could not start; stopping the others", pid)
                return code
            if time.monotonic() - started >= STABLE_S:
                self._backoff.reset()
            delay = self._backoff.next()
            log.warning("API process %d exited (%s); starting another in %.1fs", pid,
                        f"signal {-code}" if code < 0 else f"status {code}", delay)
            self._restart_at.append(time.monotonic() + delay)
            self._restart_at.sort()
        return 0

    def _stop_children(self) -> None:
        for pid in self._children:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self._children and time.monotonic() < deadline:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(POLL_S)
            else:
                self._children.pop(pid, None)
        for pid in self._children:
            log.warning("API process %d still running after %.0fs: killed", pid, STOP_GRACE_S)
            _signal(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        self._children.clear()


def _forget_metrics(pid: int) -> None:
    """Take an exited child's live gauges (requests in flight, resident memory) out of the
    processes' sum (docs/metrics.md); its counters stay counted."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        mark_process_dead(pid)  # type: ignore[no-untyped-call]


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited since the last reap
        os.kill(pid, sig)
