"""Running one async job: feed its chunks through the model's streams, collect them in order.

Chunks are requests like any other: Request envelopes admitted into the model's stream of
the job's priority (partition 0's, against its share) by the same check of rows waiting
against ``max_queue_rows`` (a full queue makes the job back off, never the interactive
traffic wait), answered by whichever inference process reads them, onto the job's own
reply list. Only a few chunks wait at a time (``job_max_in_flight``; by default one more
than the model's ready instances, so each has one running and the next one queued), so a
job uses idle capacity without crowding the queue: an urgent request waits behind at
most those few.

Each finished chunk is stored at once, so a job whose worker dies is resumed by another
from what is done (see :mod:`workers.job_tasks`). A chunk answered with a deadline or
availability error, or not answered by its deadline, is sent again; any other error
fails the job. Cancelling withdraws the chunks no worker has read yet.

A job on an ensemble sends each chunk through the ensemble's steps in order
(:mod:`batching.job_route`), each step an ordinary request of its step model: a chunk's
reply sends its next step, and the last step's outputs are the chunk's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from batching.backoff import Backoff
from batching.config import ConfigError
from batching.envelope import Reply, Tensor
from batching.errors import ConveyorError, DeadlineExceeded, Overloaded, Unavailable
from batching.job_record import (
    LEASE_LUA,
    TRANSITION_LUA,
    UNFINISHED,
    WAKE,
    JobRecord,
    JobState,
    Rows,
    count_move,
    signature,
    unpack_tensors,
)
from batching.job_route import read_route
from batching.keys import Keys
from batching.lua import pipelined
from batching.redis_errors import REDIS_UNREACHABLE
from batching.settings import Settings
from workers.job_requests import ChunkRequests, Sent, chunk_step
from workers.job_store import ChunkStore

log = logging.getLogger("conveyor.jobs")

RETRIED = frozenset({DeadlineExceeded.code, Unavailable.code, Overloaded.code})
"""Reply errors that say nothing about the rows: the chunk is sent again."""
REPLY_BATCH = 1024
"""Replies popped per round trip."""
WAIT_S = 0.25
"""Longest wait for replies between two looks at the job's state."""
CHECK_EVERY_S = 0.2
COUNT_EVERY_S = 2.0
"""How often the default in-flight limit follows the model's ready instances."""
MIN_IN_FLIGHT = 2
BACKOFF_S = (0.05, 2.0)


class JobFailed(Exception):
    """A chunk failed in the model: the job fails with this message."""


class JobRunner:
    """Feeds one job's chunks and stores their outputs; :meth:`run` returns how it ended.

    ``run`` returns SUCCEEDED, FAILED or CANCELLED once the job is finished and cleaned
    up, or RUNNING when it stopped early: ``should_stop`` said so (the worker is shutting
    down: the lease is released for another worker to resume), or another task holds
    the lease now.
    """

    def __init__(self, client: redis.Redis, keys: Keys, settings: Settings, record: JobRecord,
                 on_progress: Callable[[int, int], None],
                 should_stop: Callable[[], bool]) -> None:
        self.client = client
        self.keys = keys
        self.settings = settings
        self.record = record
        self.on_progress = on_progress
        self.should_stop = should_stop
        self.token = f"{os.getpid()}-{os.urandom(6).hex()}"
        self.error = ""
        self._job_key = keys.job(record.id)
        self._reply_key = keys.job_replies(record.id)
        self._requests = ChunkRequests(client, keys, record, self.token, self._reply_key,
                                       settings.job_chunk_timeout_s)
        self._transition = client.register_script(TRANSITION_LUA)
        self._lease = client.register_script(LEASE_LUA)
        self._store = ChunkStore(client, keys, record)
        self._sent: dict[str, Sent] = {}
        self._stored: set[int] = set()
        self._todo: deque[int] = deque()
        self._signature: list[tuple[str, str, tuple[int, ...]]] | None = None
        self._backoff_until = 0.0
        self._refused = Backoff(*BACKOFF_S)
        """Waits between re-sends of chunks the full queue refused."""
        self._next_check = 0.0
        self._in_flight = settings.job_max_in_flight or MIN_IN_FLIGHT
        self._next_count = 0.0
        self.rows: Rows

    def acquire(self, takeover: str = "") -> bool:
        """Take the job's lease (free, or held by ``takeover``: the reaper that resent it)."""
        return bool(self._lease(keys=[self.keys.job_lease(self.record.id)],
                                args=[self.token, self._lease_ms, takeover]))

    def release(self) -> None:
        self._lease(keys=[self.keys.job_lease(self.record.id)], args=[self.token, 0, ""])

    @property
    def _lease_ms(self) -> int:
        return int(self.settings.job_lease_s * 1000)

    def start(self) -> JobState | None:
        """Mark the job RUNNING if it is unfinished; return the state it was in (None: gone)."""
        fields: list[Any] = [] if self.record.started_at else ["started_at", repr(time.time())]
        before = self._transition(keys=[self._job_key],
                                  args=[JobState.RUNNING, UNFINISHED, *fields])
        if before is None:
            return None
        state = JobState(before.decode())
        if state is JobState.PENDING:
            self._count_move(state, JobState.RUNNING)
        return state

    def run(self) -> JobState:
        unreachable = Backoff(*BACKOFF_S)
        loaded = False
        while True:
            try:
                if not loaded:
                    self._load()
                    loaded = True
                if len(self._stored) == self.record.chunks:
                    return self._finish(JobState.SUCCEEDED)
                state = self._step()
                unreachable.reset()
            except REDIS_UNREACHABLE as exc:
                delay = unreachable.next()
                log.warning("job %s: Redis unreachable (%s); retrying in %.1fs", self.record.id,
                            exc, delay)
                time.sleep(delay)
                self._next_check = 0.0  # the lease may have lapsed meanwhile
                self._resend_in_flight()
                continue
            except JobFailed as exc:
                self.error = str(exc)
                return self._finish(JobState.FAILED)
            except Exception as exc:  # a bug: fail the job once rather than resume it forever
                log.exception("job %s: internal error", self.record.id)
                self.error = f"internal error: {type(exc).__name__}: {exc}"
                return self._finish(JobState.FAILED)
            if state is not None:
                return state

    def _load(self) -> None:
        """Read what is done already (a resumed job) and the inputs still to send."""
        done = [int(i) for i in self.client.hkeys(self.keys.job_chunks(self.record.id))]
        self._stored = set(done)
        record = self.record
        try:
            self._requests.route = read_route(Path(self.settings.model_repository), record.model,
                                              record.priority, record.max_queue_rows,
                                              record.outputs)
        except (ConfigError, ConveyorError) as exc:
            raise JobFailed(f"model {record.model!r} cannot run: {exc}") from None
        if record.ensemble and self._requests.route.steps[0].inputs is None:
            raise JobFailed(f"ensemble {record.model!r} is not in the job worker's "
                            "repository (CONVEYOR_MODEL_REPOSITORY)")
        data = self.client.get(self.keys.job_input(self.record.id))
        if not isinstance(data, bytes):
            raise JobFailed("the job's inputs are gone (expired)")
        self.rows = Rows(unpack_tensors(data), self.record.chunk_rows)
        self._todo = deque(i for i in range(self.record.chunks) if i not in self._stored)
        if done:
            first = self.client.hget(self.keys.job_chunks(self.record.id), done[0])
            self._signature = (signature(unpack_tensors(first)) if isinstance(first, bytes)
                               else None)
            log.info("job %s resumes: %d of %d chunks done", self.record.id, len(done),
                     self.record.chunks)
        self.record.done = sum(self.rows.rows(i) for i in self._stored)
        self.client.hset(self._job_key, "done", self.record.done)
        # Replies to the chunks an earlier run had in flight: take them before resending.
        self._take(self.client.lmpop(1, self._reply_key, direction="LEFT", count=REPLY_BATCH))

    def _step(self) -> JobState | None:
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + CHECK_EVERY_S
            state = self._check()
            if state is not None:
                return state
        if self.should_stop():
            log.info("job %s: the worker is stopping; handing the job over", self.record.id)
            self.release()
            return JobState.RUNNING
        self._resend_lost(now)
        self._feed(now)
        self._collect(now)
        return None

    def _check(self) -> JobState | None:
        """Renew the lease and the keys' TTLs; notice a cancel."""
        ttl = self.settings.job_result_ttl_s
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(self._job_key, "state")
        pipelined(pipe, LEASE_LUA, [self.keys.job_lease(self.record.id)],
                  [self.token, self._lease_ms, ""])
        for key in (self._job_key, self.keys.job_input(self.record.id),
                    self.keys.job_chunks(self.record.id)):
            pipe.expire(key, ttl)
        state, held, *_ = pipe.execute()
        if not self.settings.job_max_in_flight and time.monotonic() >= self._next_count:
            self._next_count = time.monotonic() + COUNT_EVERY_S
            self._in_flight = max(MIN_IN_FLIGHT, self._ready_instances() + 1)
        if state is None or state.decode() == JobState.CANCELLED:
            self.cancelled()
            return JobState.CANCELLED
        if not held:
            log.warning("job %s: another task holds its lease now; stopping", self.record.id)
            return JobState.RUNNING
        return None

    def _ready_instances(self) -> int:
        """Inference processes of the model with a fresh heartbeat in state ready."""
        now = time.time()
        first = self._requests.route.steps[0].model  # an ensemble's: its first step's
        beats = [json.loads(raw) for raw in self.client.hgetall(self.keys.workers(first)).values()]
        return sum(b.get("state") == "ready" and now - float(b.get("ts", 0))
                   <= self.settings.heartbeat_stale_s for b in beats)

    def _resend_in_flight(self) -> None:
        """After Redis was unreachable, every chunk in flight is sent again as soon as it
        answers: a failover to a replica, or a restart, may have lost its entry or its
        reply. Whichever attempt answers first is kept (:meth:`_on_reply`)."""
        for sent in self._sent.values():
            sent.late_at = 0.0

    def _resend_lost(self, now: float) -> None:
        lost = [rid for rid, sent in self._sent.items() if now >= sent.late_at]
        for rid in lost:
            sent = self._sent.pop(rid)
            log.warning("job %s: chunk %d given up for lost; sending it again",
                        self.record.id, sent.index)
            self._todo.appendleft(sent.index)

    def _feed(self, now: float) -> None:
        free = self._in_flight - len(self._sent)
        if free <= 0 or not self._todo or now < self._backoff_until:
            return
        batch = [self._todo.popleft() for _ in range(min(free, len(self._todo)))]
        by_step: dict[int, list[int]] = {}
        for index in batch:
            by_step.setdefault(self._requests.step_of(index), []).append(index)
        rejected: list[int] = []
        for step, indexes in by_step.items():
            sent, refused = self._requests.send(step, indexes, self.rows, now)
            self._sent.update(sent)
            rejected += refused
        if rejected:  # the queue is full: try again later, with the interactive traffic first
            self._todo.extendleft(reversed(rejected))
            self._backoff_until = now + self._refused.next()
        else:
            self._refused.reset()

    def _collect(self, now: float) -> None:
        if self._sent:
            timeout = WAIT_S
        elif self._todo:
            timeout = max(0.01, min(WAIT_S, self._backoff_until - now))
        else:
            return
        self._take(self.client.blmpop(timeout, 1, self._reply_key, direction="LEFT",
                                      count=REPLY_BATCH))

    def _take(self, popped: Any) -> None:
        """Store the chunks a popped batch of replies answers; re-queue the retriable.

        A chunk is stored and counted only once its write succeeded: the replies are off
        the list already, so a failed write sends its chunks again (when Redis is back)."""
        if not popped:
            return
        finished: dict[int, list[Tensor]] = {}
        for data in popped[1]:
            self._on_reply(Reply.decode(data), finished)
        if not finished:
            return
        try:
            done = self._store.store(finished, self.rows)
        except Exception:  # Redis lost, most likely: nothing counts as stored
            self._todo.extendleft(sorted((i for i in finished if i not in self._todo),
                                         reverse=True))
            raise
        self._stored.update(finished)
        self.record.done = done
        self.on_progress(self.record.done, self.record.total)

    def _on_reply(self, reply: Reply, finished: dict[int, list[Tensor]]) -> None:
        if reply.id == WAKE:
            self._next_check = 0.0
            return
        index, step = chunk_step(reply.id)
        sent = self._sent.pop(reply.id, None)
        route, partial = self._requests.route, self._requests.partial
        target = route.steps[step] if step < len(route.steps) else None
        if (index in self._stored or index in finished or target is None
                or step != self._requests.step_of(index)
                or (target.inputs is not None and index not in partial)):
            return  # an earlier attempt answered first, or one whose tensors are gone
        if not reply.ok:
            if reply.error_code not in RETRIED:
                where = "" if target.inputs is None else f"step {target.model!r}: "
                raise JobFailed(f"chunk {index} (rows {index * self.record.chunk_rows}..): "
                                f"{where}{reply.error}")
            if sent is not None:
                log.info("job %s: chunk %d answered %s; sending it again", self.record.id,
                         index, reply.error_code)
                self._todo.appendleft(index)
            return
        outputs = route.answered(step, partial.pop(index, (0, []))[1], reply.outputs)
        if not route.last(step):
            partial[index] = (step + 1, outputs)
        else:
            self._check_signature(index, outputs)
        for rid in [rid for rid, s in self._sent.items() if s.index == index]:
            del self._sent[rid]  # a resent chunk's first attempt answered: stop waiting
        if sent is None and index in self._todo:  # a reply to an earlier run of the job
            self._todo.remove(index)
        if route.last(step):
            finished[index] = outputs
        else:
            self._todo.appendleft(index)  # on to its next step

    def _check_signature(self, index: int, outputs: list[Tensor]) -> None:
        got = signature(outputs)
        if self._signature is None:
            self._signature = got
        elif got != self._signature:
            raise JobFailed(f"chunk {index}: the model's outputs {got} differ from the first "
                            f"chunk's {self._signature}; the rows cannot be joined")

    def _finish(self, state: JobState) -> JobState:
        """Record the end; keep the result (if any) and the record for the result TTL."""
        if state is not JobState.SUCCEEDED:
            self._withdraw_sent()
        fields = ["finished_at", repr(time.time())]
        if state is JobState.SUCCEEDED:
            fields += ["done", str(self.record.total)]
        if self.error:
            fields += ["error", self.error]
        before = self._transition(keys=[self._job_key], args=[state, JobState.RUNNING, *fields])
        if before is None or before.decode() not in (JobState.RUNNING, state):
            self.cancelled()  # cancelled while the last replies came in
            return JobState.CANCELLED
        if before.decode() == JobState.RUNNING:
            self._count_move(JobState.RUNNING, state)
        self._clean_up(keep_result=state is JobState.SUCCEEDED)
        return state

    def _count_move(self, before: JobState, after: JobState) -> None:
        pipe = self.client.pipeline(transaction=False)
        count_move(pipe, self.keys.jobs_counted(), before, after)
        pipe.execute()

    def cancelled(self) -> None:
        """The job was cancelled: withdraw what is in flight and delete all but its record."""
        log.info("job %s cancelled", self.record.id)
        self._withdraw_sent()
        self._clean_up(keep_result=False)

    def _withdraw_sent(self) -> None:
        if not self._sent:
            return
        released = self._requests.withdraw(list(self._sent.values()))
        log.info("job %s: withdrew %d unread rows of %d chunks in flight", self.record.id,
                 released, len(self._sent))
        self._sent.clear()

    def _clean_up(self, keep_result: bool) -> None:
        job_id = self.record.id
        ttl = self.settings.job_result_ttl_s
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.keys.job_input(job_id))
        pipe.delete(self._reply_key)
        if keep_result:
            pipe.expire(self.keys.job_chunks(job_id), ttl)
        else:
            pipe.delete(self.keys.job_chunks(job_id))
        pipe.expire(self._job_key, ttl)
        pipe.srem(self.keys.jobs_active(), job_id)
        pipelined(pipe, LEASE_LUA, [self.keys.job_lease(job_id)], [self.token, 0, ""])
        pipe.execute()
