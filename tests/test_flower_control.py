"""Flower shows the work (job tasks, one event per batch); the workers' control commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from celery import Celery

from batching.config import ADAPTIVE_BOUND_US
from batching.keys import Keys
from tests.conftest import TEST_MODELS, Stack
from tests.jobs_stack import add_job_worker, rows, start_flower, submit, watch
from tests.procs import ROOT, RedisServer, wait_for


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path) -> Iterator[tuple[Stack, str]]:
    stack = Stack(redis_server.url, TEST_MODELS, logdir, extra_env={"CONVEYOR_MODELS": "echo"})
    flower, flower_url = start_flower(stack)
    stack.workers.append(flower)
    stack.add_api()
    stack.add_worker()
    add_job_worker(stack)
    stack.wait_ready(timeout=90)
    yield stack, flower_url
    stack.stop()


@pytest.fixture(scope="module")
def control(stack: tuple[Stack, str]) -> Iterator[Celery]:
    """A Celery client of the stack's broker (its key prefix), for broadcasts."""
    app = Celery("test", broker=stack[0].redis_url, set_as_current=False)
    app.conf.update(broker_transport_options={
        "global_keyprefix": Keys(stack[0].prefix).celery()}, accept_content=["json"])
    yield app
    app.close()


def tasks(flower_url: str, **query: str) -> dict[str, dict[str, Any]]:
    response = httpx.get(f"{flower_url}/api/tasks", params=query, timeout=10)
    assert response.status_code == 200, response.text
    found: dict[str, dict[str, Any]] = response.json()
    return found


def test_flower_lists_the_job_task_with_progress_and_every_batch(stack: tuple[Stack, str]) -> None:
    stack_, flower = stack
    x = rows(6000)
    job_id = submit(stack_, x)
    progress: list[dict[str, int]] = []

    def seen_progress() -> bool:
        task = tasks(flower, taskname="conveyor.job").get(job_id, {})
        if task.get("state") == "PROGRESS":
            progress.append(json.loads(task["result"]))
        return bool(progress) and 0 < progress[-1]["done"] < 6000

    wait_for(seen_progress, 30, "Flower to show the job's progress")
    assert progress[-1]["total"] == 6000
    assert watch(stack_, job_id)[0]["state"] == "SUCCEEDED"
    wait_for(lambda: tasks(flower, taskname="conveyor.job")[job_id]["state"] == "SUCCESS", 10,
             "Flower to show the job's task succeeded")
    job = tasks(flower, taskname="conveyor.job")[job_id]
    assert job["worker"].startswith("jobs-") and job["runtime"] > 0

    def batch_rows() -> int:
        return sum(json.loads(b["kwargs"])["rows"]
                   for b in tasks(flower, taskname="conveyor.batch[echo]").values())

    # Batch events go out every 0.25 s, so the last ones reach Flower after the job ends.
    wait_for(lambda: batch_rows() >= 6000, 10, "Flower to have every batch's event")
    batches = tasks(flower, taskname="conveyor.batch[echo]")
    assert len(batches) >= 6000 // 32
    one = next(iter(batches.values()))
    assert one["state"] == "SUCCESS" and one["runtime"] > 0.015  # echo sleeps 20 ms a batch
    assert json.loads(one["kwargs"])["rows"] >= 1
    assert one["worker"].startswith("worker-")

    metrics = httpx.get(f"{flower}/metrics").text
    assert 'task="conveyor.batch[echo]"' in metrics
    assert "flower_task_runtime_seconds_bucket" in metrics
    workers = httpx.get(f"{flower}/api/workers", params={"refresh": "true"}, timeout=30).json()
    assert any(name.startswith("worker-") for name in workers)
    assert any(name.startswith("jobs-") for name in workers)


Replies = list[dict[str, dict[str, Any]]]
"""What a broadcast with ``reply=True`` returns (Celery types it as optional): one
{worker name: answer} per worker."""


def stats(control: Celery) -> dict[str, Any]:
    """conveyor_stats of the inference worker (the job worker answers {})."""
    replies = cast(Replies, control.control.broadcast("conveyor_stats", reply=True, timeout=5, limit=2))
    answers = {name: body for reply in replies for name, body in reply.items()}
    assert len(answers) == 2, answers
    [inference] = [body for name, body in answers.items() if name.startswith("worker-")]
    assert [body for name, body in answers.items() if name.startswith("jobs-")] == [{}]
    return inference


def set_batching(control: Celery, **arguments: Any) -> dict[str, Any]:
    """conveyor_set_batching's answer from the inference worker (a job worker declines)."""
    replies = cast(Replies, control.control.broadcast("conveyor_set_batching", arguments=arguments,
                                                      reply=True, timeout=5, limit=2))
    answers = {name: body for reply in replies for name, body in reply.items()}
    assert len(answers) == 2, answers
    [declined] = [body for name, body in answers.items() if name.startswith("jobs-")]
    assert declined == {"error": "this worker runs no inference processes"}
    [inference] = [body for name, body in answers.items() if name.startswith("worker-")]
    return inference


def infer_batch_rows(stack: Stack, clients: int = 24) -> list[int]:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}

    def one(_: int) -> int:
        response = httpx.post(f"{stack.url}/v2/models/echo/infer", json=body, timeout=30)
        outputs = {o["name"]: o["data"] for o in response.json()["outputs"]}
        return int(outputs["batch_rows"][0])

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(clients * 3)))


def test_control_commands_answer_and_take_effect(stack: tuple[Stack, str],
                                                 control: Celery) -> None:
    stack_ = stack[0]
    infer_batch_rows(stack_, clients=4)
    wait_for(lambda: stats(control)["echo"]["batches"] > 0, 10, "figures in the heartbeats")
    echo = stats(control)["echo"]
    assert echo["state"] == "ready" and echo["row_cap"] == 32
    assert echo["rows"] >= echo["batches"] > 0
    assert echo["mean_batch"] == pytest.approx(echo["rows"] / echo["batches"])
    [instance] = echo["instances"]
    assert instance["max_batch_size"] == 32 and instance["max_queue_delay_us"] == ADAPTIVE_BOUND_US

    assert set_batching(control, model="echo", max_batch_size=3, max_queue_delay_us=2000) == {
        "ok": True, "model": "echo", "set": {"max_queue_delay_us": 2000, "max_batch_size": 3}}
    try:
        wait_for(lambda: stats(control)["echo"]["instances"][0]["max_batch_size"] == 3, 10,
                 "the new max_batch_size to apply")
        assert stats(control)["echo"]["instances"][0]["max_queue_delay_us"] == 2000
        assert max(infer_batch_rows(stack_)) <= 3
    finally:
        set_batching(control, model="echo", max_batch_size=32, max_queue_delay_us=0)
    wait_for(lambda: stats(control)["echo"]["instances"][0]["max_batch_size"] == 32, 10,
             "max_batch_size to be restored")
    # The worker may keep up with a round of clients; some round forms a batch above 3.
    wait_for(lambda: max(infer_batch_rows(stack_)) > 3, 30, "a batch above 3 rows")

    assert "1..32" in set_batching(control, model="echo", max_batch_size=1000)["error"]
    assert "not served" in set_batching(control, model="nope", max_batch_size=4)["error"]


def test_control_commands_from_the_celery_command_line(stack: tuple[Stack, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "workers.app", "control",
                           "conveyor_stats", "--timeout", "2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **stack[0].env})
    assert done.returncode == 0, done.stderr
    assert "'echo'" in done.stdout or '"echo"' in done.stdout, done.stdout
