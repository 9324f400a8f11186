"""Entries an inference process answers without running them: each with an error reply
(:func:`answer_unrun`), and, at every step, those that can no longer be answered in time
(:class:`Expiry`): their deadline has passed, or, past capacity, no batch started now
would answer them before it (batching/shedding.py)."""

from __future__ import annotations

import time

from batching.config import ModelConfig
from batching.envelope import Reply
from batching.errors import ConveyorError, DeadlineExceeded, Overloaded
from batching.former import BatchFormer, Entry
from batching.memory import RowCap
from batching.policy import TunablePolicy
from workers.stream_port import StreamPort

OVERLOAD_READ = 8
"""Past capacity with ``lifo``, the rows held here, in batches: every read takes in the
newest waiting (the streams hand out the oldest first), up to this many batches' worth."""


def answer_unrun(streams: StreamPort, entries: list[Entry], exc: ConveyorError,
                 extra: dict[str, int] | None = None) -> None:
    """Answer ``entries`` with ``exc`` and count them failed (with ``extra`` counters)."""
    now_ms = time.time() * 1000.0
    fail_ns = sum(int(max(0.0, now_ms - e.request.enq_ms) * 1e6) for e in entries)
    streams.answer(
        [(e, Reply(e.request.id, error_code=exc.code, error=exc.message)) for e in entries],
        {"fail_count": len(entries), "fail_ns": fail_ns, **(extra or {})})


class Expiry:
    """What waits in ``former`` past its deadline, and whether this process is past
    capacity: a standing queue. Past capacity with ``batching.overload: lifo`` (the
    adaptive policy), the former serves the newest first and what cannot be answered within
    the latency target is answered at once (Overloaded, or DeadlineExceeded when its own
    deadline is the sooner), and reads take in up to ``OVERLOAD_READ`` times a batch, so
    that the newest waiting are in reach."""

    def __init__(self, config: ModelConfig, former: BatchFormer, policy: TunablePolicy,
                 row_cap: RowCap, streams: StreamPort) -> None:
        self._former = former
        self._policy = policy
        self._row_cap = row_cap
        self._streams = streams
        self._lifo = former.lifo
        self._backlog_since: float | None = None
        """Since when every read took all the rows there was room for (None: the last one
        did not): more is waiting. Past capacity once it has lasted ``_sustained_s``."""
        self.overloaded = False
        """Past capacity, until the queue has stayed drained for ``_sustained_s``."""
        self._drained_since: float | None = None
        """Past capacity, since when the queue has been drained (None: it is not)."""
        self.in_time_rows = 0
        """Past capacity, the most rows the next batch may hold so that all of them are
        answered in time (0: no such bound now)."""
        self._sustained_s = config.batching.latency_target_ms / 1000.0
        """A backlog shorter than the latency target is a burst the queue absorbs (its
        requests wait, and still make it); one that lasts it is more than this process
        serves."""

    def room(self, bound: int) -> int:
        """The rows this process may hold, read or waiting to run, of which a batch holds
        at most ``bound``."""
        return bound * OVERLOAD_READ if self.overloaded and self._lifo else bound

    def read(self, got: int, room: int, now: float) -> None:
        """A read at ``now`` with ``room`` for rows took ``got`` entries (already added to
        the former). Past capacity begins once every read has been full for as long as the
        latency target and the oldest waiting has waited longer than it: a queue that
        stands, not one that a burst filled and that still answers in time."""
        if got < room:
            self._backlog_since = None
        elif self._backlog_since is None:
            self._backlog_since = now
        elif (now - self._backlog_since >= self._sustained_s
              and self._former.waited(now) >= self._sustained_s):
            self._set(True)

    def formed(self, left: int, now: float) -> None:
        """A batch was formed, or refusals answered, leaving ``left`` entries waiting here.
        Past capacity ends once the queue has stayed drained (each took all that waited,
        after a read that was not full) for as long as the latency target: a queue that
        only drains now and then is still standing."""
        if left or self._backlog_since is not None:
            self._drained_since = None
        elif self._drained_since is None:
            self._drained_since = now
        elif now - self._drained_since >= self._sustained_s:
            self._set(False)

    def _set(self, on: bool) -> None:
        self.overloaded = on
        self._drained_since = None
        self._former.overload(on)

    def answer(self, now: float) -> None:
        """Answer, without running them, the entries whose deadline has passed, and, past
        capacity, those the policy says a batch started now could not answer in time
        (before their deadline; with ``lifo``, within the latency target too). Below
        capacity, and in a burst, nothing is shed on a forecast: a noisy fit would cost
        requests that make it. Nothing left waiting counts as a drained queue too."""
        former = self._former
        expired = former.take_expired(now)
        if expired:
            answer_unrun(self._streams, expired, DeadlineExceeded("deadline passed while queued"))
        self.in_time_rows = 0
        if self.overloaded:
            self._shed(now)
            self.formed(len(former), now)

    def _shed(self, now: float) -> None:
        horizon = self._policy.shed_horizon_s
        if not len(self._former) or horizon(1) <= 0.0:
            return
        late, self.in_time_rows, missed = self._former.take_unanswerable(
            now, horizon, self._row_cap.cap, self._lifo)
        took = f"a batch takes about {horizon(max(self.in_time_rows, 1)) * 1e3:.1f} ms here now"
        own = [e for e in late if e.deadline < missed]
        if own:
            answer_unrun(self._streams, own, DeadlineExceeded(
                f"cannot be answered before its deadline: {took}"), {"shed_count": len(own)})
        target = [e for e in late if e.deadline >= missed]
        if target:
            answer_unrun(self._streams, target, Overloaded(
                f"past capacity: cannot be answered within the model's latency target "
                f"({self._sustained_s * 1e3:g} ms): {took}"), {"shed_count": len(target)})
