"""Entries an inference process answers without running them: each with an error reply
(:func:`answer_unrun`), and, at every step, those that can no longer be answered in time
(:class:`Expiry`): their deadline has passed, or, past capacity, no batch started now
would answer them before it (batching/shedding.py)."""

from __future__ import annotations

import time

from batching.config import ModelConfig
from batching.envelope import Reply
from batching.errors import ConveyorError, DeadlineExceeded
from batching.former import BatchFormer, Entry
from batching.memory import RowCap
from batching.policy import TunablePolicy
from workers.stream_port import StreamPort


def answer_unrun(streams: StreamPort, entries: list[Entry], exc: ConveyorError,
                 extra: dict[str, int] | None = None) -> None:
    """Answer ``entries`` with ``exc`` and count them failed (with ``extra`` counters)."""
    now_ms = time.time() * 1000.0
    fail_ns = sum(int(max(0.0, now_ms - e.request.enq_ms) * 1e6) for e in entries)
    streams.answer(
        [(e, Reply(e.request.id, error_code=exc.code, error=exc.message)) for e in entries],
        {"fail_count": len(entries), "fail_ns": fail_ns, **(extra or {})})


class Expiry:
    """What waits in ``former`` past its deadline, and the backlog that says whether this
    process is past capacity."""

    def __init__(self, config: ModelConfig, former: BatchFormer, policy: TunablePolicy,
                 row_cap: RowCap, streams: StreamPort) -> None:
        self._former = former
        self._policy = policy
        self._row_cap = row_cap
        self._streams = streams
        self._backlog_since: float | None = None
        """Since when every read took all the rows there was room for (None: the last one
        did not): more is waiting. Past capacity once it has lasted ``_sustained_s``."""
        self.in_time_rows = 0
        """Past capacity, the most rows the next batch may hold so that all of them are
        answered in time (0: no such bound now)."""
        self._sustained_s = config.batching.latency_target_ms / 1000.0
        """A backlog shorter than the latency target is a burst the queue absorbs (its
        requests wait, and still make it); one that lasts it is more than this process
        serves."""

    def read(self, got: int, room: int, now: float) -> None:
        """A read at ``now`` with ``room`` for rows took ``got`` entries."""
        if got < room:
            self._backlog_since = None
        elif self._backlog_since is None:
            self._backlog_since = now

    def answer(self, now: float) -> None:
        """Answer, without running them, the entries whose deadline has passed, and, while
        more has waited than this process can hold for as long as the latency target (past
        capacity), those the policy says a batch started now could not answer in time.
        Below capacity, and in a burst, nothing is shed on a forecast: a noisy fit would
        cost requests that make it."""
        former = self._former
        expired = former.take_expired(now)
        if expired:
            answer_unrun(self._streams, expired, DeadlineExceeded("deadline passed while queued"))
        self.in_time_rows = 0
        since = self._backlog_since
        if not len(former) or since is None or now - since < self._sustained_s:
            return
        horizon = self._policy.shed_horizon_s
        if horizon(1) <= 0.0:
            return
        late, self.in_time_rows = former.take_unanswerable(now, horizon, self._row_cap.cap)
        if late:
            took = horizon(max(self.in_time_rows, 1))
            answer_unrun(self._streams, late, DeadlineExceeded(
                f"cannot be answered before its deadline: a batch takes about "
                f"{took * 1e3:.1f} ms here now"), {"shed_count": len(late)})
