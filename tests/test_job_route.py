"""The steps a job's chunk goes through (batching/job_route.py), read from a repository."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import redis

from batching.config import ConfigError
from batching.envelope import Tensor
from batching.job_record import JobRecord, JobState, pack_tensors
from batching.job_route import JobStep, read_route
from batching.keys import Keys
from batching.settings import Settings
from tests.procs import ROOT, RedisServer
from tests.protocol_stack import PROTOCOL_MODELS
from workers.job_runner import JobRunner

MODELS = ROOT / "tests" / "ensemble_models"


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    for folder in MODELS.iterdir():
        shutil.copytree(folder, tmp_path / folder.name)
    shutil.copytree(PROTOCOL_MODELS / "simple", tmp_path / "simple")
    return tmp_path


def tensor(name: str, value: int) -> Tensor:
    return Tensor.from_array(name, np.full((2, 16), value, np.int32))


def test_a_model_is_one_step_and_an_ensemble_its_steps_in_order(repository: Path) -> None:
    plain = read_route(repository, "simple", 3, 100, [])
    assert plain.steps == (JobStep("simple", "", 3, 100),)
    outputs = [tensor("OUTPUT0", 1)]
    assert plain.answered(0, [], outputs) is outputs  # a model's outputs as it answers them
    route = read_route(repository, "add_sub_twice", 9, 100, ["OUTPUT0"])
    assert [(s.model, s.priority) for s in route.steps] == [("simple", 3), ("simple", 3)]
    chunk = [tensor("INPUT0", 5), tensor("INPUT1", 2)]
    first = route.answered(0, chunk, [tensor("OUTPUT0", 7), tensor("OUTPUT1", 3)])
    assert sorted(t.name for t in first) == ["DIFF", "INPUT0", "INPUT1", "SUM"]
    asked = route.inputs(1, first)
    assert [(t.name, t.array()[0, 0]) for t in asked] == [("INPUT0", 7), ("INPUT1", 3)]
    assert route.wanted(1, []) == ["OUTPUT0", "OUTPUT1"]
    last = route.answered(1, first, [tensor("OUTPUT0", 10), tensor("OUTPUT1", 4)])
    assert [t.name for t in last] == ["OUTPUT0"]  # the job's outputs only


def test_a_conditional_ensemble_has_no_route(repository: Path) -> None:
    with pytest.raises(ConfigError, match="'classify' is conditional"):
        read_route(repository, "pipeline", 1, 100, [])


def test_a_job_on_an_ensemble_the_job_worker_cannot_read_fails_naming_it(
        redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    record = JobRecord(id=uuid.uuid4().hex, model="add_sub_twice", state=JobState.PENDING,
                       total=2, priority=1, chunk_rows=2, max_queue_rows=100,
                       created_at=time.time(), ensemble=True)
    client.set(keys.job_input(record.id), pack_tensors([tensor("INPUT0", 1), tensor("INPUT1", 2)]))
    client.hset(keys.job(record.id), mapping=cast(Mapping[Any, str], record.to_hash()))
    runner = JobRunner(client, keys, Settings(redis_url=redis_server.url,
                                              model_repository=tmp_path),
                       record, lambda _done, _total: None, lambda: False)
    assert runner.acquire() and runner.start() is JobState.PENDING
    assert runner.run() is JobState.FAILED
    assert runner.error == ("ensemble 'add_sub_twice' is not in the job worker's repository "
                            "(CONVEYOR_MODEL_REPOSITORY)")
    assert client.xlen(keys.queue("add_sub_twice", 1)) == 0  # nothing sent where none reads
