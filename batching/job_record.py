"""Async jobs: the record, its states and the tensor packing the API and job workers share.

A job lives in Redis under its own hash tag (see :class:`batching.keys.Keys`): a hash with
its state and progress, its packed inputs, and one packed entry per finished chunk of
rows. The API writes the job and reads its result; a Celery task on ``cv.jobs`` feeds the
chunks through the model's streams, like any request, and stores their outputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import msgpack
import orjson

from batching.envelope import Tensor
from batching.lua import script
from batching.repository_scan import as_text

JOB_TASK = "conveyor.job"
CALLBACK_TASK = "conveyor.job_callback"
JOB_QUEUE = "cv.jobs"
"""The Celery queue of job tasks; only job workers (``-Q cv.jobs``) consume it."""
WAKE = "wake"
"""The id of the reply the API pushes onto a running job's reply list when it cancels it."""

ADMIT_LUA = script("admit_many").text
"""Admission of a job's chunks for one stream in one call, each in turn against the row
limit (the API admits requests with the same script)."""
WITHDRAW_LUA = script("job_withdraw").text
TRANSITION_LUA = script("job_transition").text
LEASE_LUA = script("job_lease").text
STORE_LUA = script("job_store").text
"""A job's finished chunks stored, each counted into its progress once."""


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


FINISHED = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
UNFINISHED = f"{JobState.PENDING},{JobState.RUNNING}"
"""The states a job may leave, in the form job_transition.lua takes."""


def count_move(pipe: Any, counted_key: str, before: str | None, after: str | None) -> None:
    """Queue on ``pipe`` the change to the job counts (``Keys.jobs_counted``) of a job
    that moved from state ``before`` (None: a new job) to ``after`` (None: deleted)."""
    if before is not None:
        pipe.hincrby(counted_key, before, -1)
    if after is not None:
        pipe.hincrby(counted_key, after, 1)


@dataclass(slots=True)
class JobRecord:
    """The job hash, typed. Timestamps are Unix seconds; 0 means not yet."""

    id: str
    model: str
    state: JobState
    total: int
    priority: int
    chunk_rows: int
    max_queue_rows: int
    created_at: float
    outputs: list[str] = field(default_factory=list)
    callback_url: str = ""
    owner: str = ""
    """The SHA-256 digest of the API key that submitted the job ("" without keys): only
    that key (or an admin key) sees, lists or cancels it. Never the key itself."""
    ensemble: bool = False
    """The model is an ensemble: its chunks go through its steps (batching/job_route.py)."""
    done: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    error: str = ""

    @property
    def chunks(self) -> int:
        return math.ceil(self.total / self.chunk_rows)

    def to_hash(self) -> dict[str, str]:
        return {
            "model": self.model, "state": self.state.value, "total": str(self.total),
            "priority": str(self.priority), "chunk_rows": str(self.chunk_rows),
            "max_queue_rows": str(self.max_queue_rows), "created_at": repr(self.created_at),
            "outputs": orjson.dumps(self.outputs).decode(), "callback_url": self.callback_url,
            "owner": self.owner, "ensemble": "1" if self.ensemble else "",
            "done": str(self.done), "started_at": repr(self.started_at),
            "finished_at": repr(self.finished_at), "error": self.error,
        }

    @classmethod
    def from_hash(cls, job_id: str, raw: Mapping[bytes | str, bytes | str]) -> JobRecord:
        text = {as_text(k): as_text(v) for k, v in raw.items()}
        return cls(
            id=job_id, model=text["model"], state=JobState(text["state"]),
            total=int(text["total"]), priority=int(text["priority"]),
            chunk_rows=int(text["chunk_rows"]), max_queue_rows=int(text["max_queue_rows"]),
            created_at=float(text["created_at"]), outputs=orjson.loads(text["outputs"]),
            callback_url=text.get("callback_url", ""), owner=text.get("owner", ""),
            ensemble=text.get("ensemble") == "1",
            done=int(text.get("done", 0)),
            started_at=float(text.get("started_at", 0)),
            finished_at=float(text.get("finished_at", 0)), error=text.get("error", ""),
        )

    def view(self) -> dict[str, Any]:
        """What ``GET /v1/jobs/{id}`` answers (and a callback receives); not the owner."""
        body: dict[str, Any] = {
            "id": self.id, "model": self.model, "state": self.state.value,
            "progress": {"done": self.done, "total": self.total},
            "created_at": iso_time(self.created_at), "started_at": iso_time(self.started_at),
            "finished_at": iso_time(self.finished_at),
        }
        if self.error:
            body["error"] = self.error
        return body


def iso_time(ts: float) -> str | None:
    """RFC 3339 UTC with milliseconds, or None for 0 (not yet)."""
    if not ts:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def pack_tensors(tensors: list[Tensor]) -> bytes:
    packed: bytes = msgpack.packb([t.pack() for t in tensors], use_bin_type=True)
    return packed


def unpack_tensors(data: bytes) -> list[Tensor]:
    return [Tensor.unpack(t) for t in msgpack.unpackb(data, raw=False)]


class Rows:
    """A job's input tensors, cut on demand into chunks of ``chunk_rows`` rows."""

    def __init__(self, tensors: list[Tensor], chunk_rows: int) -> None:
        self._tensors = [(t.name, t.datatype, t.array()) for t in tensors]
        self.total = tensors[0].shape[0]
        self.chunk_rows = chunk_rows

    def __len__(self) -> int:
        return math.ceil(self.total / self.chunk_rows)

    def rows(self, index: int) -> int:
        return min(self.chunk_rows, self.total - index * self.chunk_rows)

    def chunk(self, index: int) -> list[Tensor]:
        start = index * self.chunk_rows
        stop = start + self.rows(index)
        return [Tensor.from_array(name, array[start:stop], datatype)
                for name, datatype, array in self._tensors]


def signature(tensors: list[Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, datatype, dims after the batch dim) per tensor: what every chunk must share."""
    return [(t.name, t.datatype, t.shape[1:]) for t in tensors]


def join_chunks(chunks: list[list[Tensor]]) -> list[Tensor]:
    """Concatenate each output along the batch axis, chunk by chunk, as raw bytes.

    Raw tensors are row-major (BYTES elements length-prefixed), so the rows of one tensor
    after another are the bytes of one after the other. Chunks must share
    :func:`signature` (the job worker checks it as they arrive).
    """
    joined = []
    for i, first in enumerate(chunks[0]):
        parts = [chunk[i] for chunk in chunks]
        rows = sum(t.shape[0] for t in parts)
        joined.append(Tensor(first.name, first.datatype, (rows, *first.shape[1:]),
                             b"".join(t.raw for t in parts)))
    return joined
