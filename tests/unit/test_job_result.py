"""``GET /v1/jobs/{id}/result`` over the chunks a job worker stored (in the fake Redis):
all of them join in order; none left is an expired result (404); some missing is a 500
that says which, never a bare KeyError."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
from fastapi.testclient import TestClient

from batching.envelope import Tensor
from batching.job_record import JobRecord, JobState, pack_tensors
from tests.unit.memory_dispatch import MemoryDispatcher


def succeeded(dispatcher: MemoryDispatcher, stored: list[int]) -> str:
    """A SUCCEEDED job of 6 rows in 3 chunks of 2, whose chunks ``stored`` are in Redis."""
    record = JobRecord(id=uuid.uuid4().hex, model="echo", state=JobState.SUCCEEDED, total=6,
                       priority=1, chunk_rows=2, max_queue_rows=1000, created_at=time.time(),
                       done=6, started_at=time.time(), finished_at=time.time())
    keys = dispatcher.keys
    with dispatcher.sync_redis() as redis:
        redis.hset(keys.job(record.id), mapping=cast(Mapping[Any, str], record.to_hash()))
        for i in stored:
            y = np.full((2, 4), i, np.float32)
            redis.hset(keys.job_chunks(record.id), str(i), pack_tensors([Tensor.from_array("y", y)]))
    return record.id


def test_every_chunk_joins_in_order(client: TestClient, dispatcher: MemoryDispatcher) -> None:
    response = client.get(f"/v1/jobs/{succeeded(dispatcher, [2, 0, 1])}/result")
    assert response.status_code == 200, response.text
    [y] = response.json()["outputs"]
    assert y["shape"] == [6, 4] and y["data"][::8] == [0, 1, 2]


def test_a_missing_chunk_is_a_500_that_names_it(client: TestClient,
                                                dispatcher: MemoryDispatcher) -> None:
    job_id = succeeded(dispatcher, [0, 2])
    response = client.get(f"/v1/jobs/{job_id}/result")
    assert response.status_code == 500
    assert response.json()["error"] == (f"the result of job {job_id} is incomplete: 1 of its "
                                         "3 chunks are missing (first: [1])")


def test_no_chunk_left_is_an_expired_result(client: TestClient,
                                            dispatcher: MemoryDispatcher) -> None:
    job_id = succeeded(dispatcher, [])
    response = client.get(f"/v1/jobs/{job_id}/result")
    assert response.status_code == 404
    assert response.json()["error"] == f"the result of job {job_id} expired"
