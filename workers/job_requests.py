"""The requests of one job's chunks: built for their step, admitted, withdrawn.

A chunk's request goes to the stream of its step's model at the step's priority
(partition 0, against that model's share of ``max_queue_rows``) with a deadline of
``job_chunk_timeout_s``; its id names the job, the chunk, the attempt and the step, so
its reply finds its place. The chunks of a job on an ensemble keep their tensors between
steps here (:attr:`ChunkRequests.partial`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis

from batching.envelope import VERSION, Request, Tensor
from batching.job_record import ADMIT_LUA, WITHDRAW_LUA, JobRecord, Rows
from batching.job_route import JobRoute, model_route
from batching.keys import GROUP, Keys

LATE_GRACE_S = 30.0
"""A chunk unanswered this long after its deadline was lost (say, Redis restarted)."""


@dataclass(slots=True)
class Sent:
    """A chunk admitted into a stream and not answered yet."""

    index: int
    stream: str
    entry_id: str
    rows: int
    late_at: float
    """Monotonic time after which its reply is given up for lost."""
    rows_key: str = ""
    """The rows-waiting counter of its stream's model."""


def chunk_step(reply_id: str) -> tuple[int, int]:
    """The chunk and the step a reply answers."""
    parts = reply_id.split(":")
    return int(parts[1]), int(parts[3]) if len(parts) > 3 else 0


@dataclass(slots=True)
class ChunkRequests:
    """Sends one job's chunk requests and takes back the unread ones."""

    client: redis.Redis
    keys: Keys
    record: JobRecord
    token: str
    reply_key: str
    timeout_s: float
    route: JobRoute = field(init=False)
    partial: dict[int, tuple[int, list[Tensor]]] = field(default_factory=dict)
    """Chunks of an ensemble's job: the step each is at and its tensors so far."""
    _attempts: int = 0
    _admit: Any = None
    _withdraw: Any = None

    def __post_init__(self) -> None:
        self.route = model_route(self.record.model, self.record.priority,
                                 self.record.max_queue_rows)
        self._admit = self.client.register_script(ADMIT_LUA)
        self._withdraw = self.client.register_script(WITHDRAW_LUA)

    def step_of(self, index: int) -> int:
        return self.partial.get(index, (0, []))[0]

    def send(self, step: int, indexes: list[int], rows: Rows,
             now: float) -> tuple[dict[str, Sent], list[int]]:
        """Admit the requests of chunks ``indexes`` at ``step`` in one call: those admitted
        (by request id), and the indexes the full queue refused."""
        target = self.route.steps[step]
        stream = self.keys.queue(target.model, target.priority)
        rows_key = self.keys.rows_waiting(target.model)
        wall_ms = int(time.time() * 1000)
        deadline_ms = wall_ms + int(self.timeout_s * 1000)
        requests = []
        args: list[Any] = [target.max_queue_rows]
        for index in indexes:
            self._attempts += 1
            tensors = self.partial[index][1] if index in self.partial else rows.chunk(index)
            if target.inputs is not None:  # an ensemble's: later steps need the tensors
                self.partial.setdefault(index, (step, tensors))
            request = Request(
                id=f"{self.record.id}:{index}:{self.token}.{self._attempts}:{step}",
                reply=self.reply_key, deadline_ms=deadline_ms, enq_ms=wall_ms,
                prio=target.priority, inputs=self.route.inputs(step, tensors),
                outputs=self.route.wanted(step, self.record.outputs),
                params={VERSION: target.version} if target.version else {})
            requests.append(request)
            args += (request.rows, request.encode())
        admitted = self._admit(keys=[rows_key, stream], args=args)
        late_at = now + self.timeout_s + LATE_GRACE_S
        sent: dict[str, Sent] = {}
        refused: list[int] = []
        for index, request, (waiting, entry_id) in zip(indexes, requests, admitted, strict=True):
            if waiting < 0:
                refused.append(index)
            else:
                sent[request.id] = Sent(index, stream, entry_id.decode(), request.rows, late_at,
                                        rows_key)
        return sent, refused

    def withdraw(self, sent: list[Sent]) -> int:
        """Delete the entries of ``sent`` no worker has read; the rows released."""
        by_model: dict[str, list[Sent]] = {}
        for s in sent:
            by_model.setdefault(s.rows_key, []).append(s)
        released = 0
        for rows_key, group in by_model.items():
            args: list[Any] = [GROUP]
            for s in group:
                args += [s.entry_id, s.rows]
            released += int(self._withdraw(keys=[rows_key, *(s.stream for s in group)],
                                           args=args))
        return released
