"""The model thread of a pipelined inference process: runs one batch at a time.

The inference loop launches a batch here and goes back to Redis: while the model runs
(``predict`` releases the GIL in every backend, as ``time.sleep`` does), the loop reads
and forms the next batch and answers the previous one. The thread holds at most one job
and touches nothing but the job: every Redis call, every counter and every decision stays
on the loop's thread, so the streams need no lock and the failure semantics stay the
loop's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class ModelThread(Generic[T]):
    """One daemon thread, one job at a time: :meth:`launch`, then :meth:`wait` and
    :meth:`collect`. The thread starts with the first job, so a loop that never launches
    one (step-by-step tests, the sequential loop) starts none."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._changed = threading.Condition()
        self._job: Callable[[], T] | None = None
        self._done = False
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.busy = False
        """A job was launched and its outcome not yet collected."""

    def launch(self, job: Callable[[], T]) -> None:
        if self.busy:
            raise RuntimeError("the model thread is already running a job")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        with self._changed:
            self.busy = True
            self._done = False
            self._job = job
            self._changed.notify_all()

    def wait(self, timeout_s: float | None) -> bool:
        """Whether the job has finished, waiting at most ``timeout_s`` (None: until it has)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._done, timeout_s)

    def collect(self) -> T:
        """The finished job's result; what it raised is raised here, on the caller's thread."""
        with self._changed:
            if not self._done:
                raise RuntimeError("the model thread's job has not finished")
            result, error = self._result, self._error
            self._result = self._error = None
            self._done = self.busy = False
        if error is not None:
            raise error
        return cast(T, result)

    def _serve(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._job is not None)
                job = cast(Callable[[], T], self._job)
                self._job = None
            result: T | None = None
            error: BaseException | None = None
            try:
                result = job()
            except BaseException as exc:  # handed to the loop's thread, which decides
                error = exc
            with self._changed:
                self._result, self._error, self._done = result, error, True
                self._changed.notify_all()
