"""Flower shows the work as it is (job tasks, batch tasks and their outcome, the worker's
models); the model queues page; the workers' control commands.

The stack serves echo (20 ms a batch) and picky (raises on negative rows), with few batch
events a second so that batches are merged. The last test opens the pages in headless
Chromium (it skips without it); with ``CONVEYOR_FLOWER_SCREENS=docs/img`` it also saves
the screenshots docs/jobs.md shows.
"""

from __future__ import annotations

import html
import json
import os
import re
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
from tests import browser
from tests.conftest import Stack
from tests.jobs_stack import add_job_worker, echo_and_picky, rows, start_flower, submit, watch
from tests.procs import ROOT, RedisServer, wait_for

EVENTS_PER_S = "36"
"""9 events a flush: 3 batch tasks, so past 3 batches in 0.25 s all but the first are merged
(echo runs some 40 a second)."""


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    stack = Stack(redis_server.url, echo_and_picky(tmp_path_factory.mktemp("flower")), logdir,
                  extra_env={"CONVEYOR_BATCH_EVENTS_PER_S": EVENTS_PER_S})
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
    batches = tasks(flower, taskname="conveyor.batch[echo]").values()
    counts = [json.loads(b["kwargs"])["batches"] for b in batches]
    assert sum(counts) >= 6000 // 32 > len(counts)  # every batch, some merged
    for batch in batches:
        assert batch["state"] == "SUCCESS" and batch["runtime"] > 0.015  # echo: 20 ms a batch
        assert batch["received"] <= batch["started"] < batch["succeeded"]
        assert batch["worker"].startswith("worker-")
    merged = next(b for b in batches if json.loads(b["kwargs"])["batches"] > 1)
    many = json.loads(merged["kwargs"])["batches"]
    assert merged["result"].startswith(f"{many} batches merged: ")

    metrics = httpx.get(f"{flower}/metrics").text
    assert 'task="conveyor.batch[echo]"' in metrics
    assert "flower_task_runtime_seconds_bucket" in metrics
    workers = httpx.get(f"{flower}/api/workers", params={"refresh": "true"}, timeout=30).json()
    assert any(name.startswith("worker-") for name in workers)
    assert any(name.startswith("jobs-") for name in workers)


def worker_counts(flower_url: str, prefix: str) -> dict[str, int]:
    """The counts of Flower's workers page (processed is task-received) of the one worker
    whose name starts with ``prefix``."""
    response = httpx.get(f"{flower_url}/workers", params={"json": "1"}, timeout=10)
    [worker] = [w for w in response.json()["data"] if w["hostname"].startswith(prefix)]
    return {k: int(v) for k, v in worker.items() if k.startswith("task-")}


def test_a_failed_batch_is_a_failure_and_the_worker_counts_it(stack: tuple[Stack, str]) -> None:
    stack_, flower = stack
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [-1, 2, 3, 4]}]}
    response = httpx.post(f"{stack_.url}/v2/models/picky/infer", json=body, timeout=30)
    assert response.status_code == 500, response.text

    def failed() -> list[dict[str, Any]]:
        return [t for t in tasks(flower, taskname="conveyor.batch[picky]").values()
                if t["state"] == "FAILURE"]

    wait_for(lambda: bool(failed()), 10, "Flower to show the batch failed")
    [batch] = failed()
    assert batch["exception"] == ("model_failure: model 'picky' failed: ValueError: negative "
                                  "row [-1.0, 2.0, 3.0, 4.0]")
    assert batch["received"] <= batch["started"] < batch["failed"]
    kwargs = json.loads(batch["kwargs"])
    assert (kwargs["rows"], kwargs["batches"]) == (1, 1)
    counts = worker_counts(flower, "worker-")
    assert counts["task-failed"] >= 1
    assert counts["task-received"] == counts["task-started"] == (
        counts["task-succeeded"] + counts["task-failed"])


def test_a_cancelled_job_is_revoked_in_flower(stack: tuple[Stack, str]) -> None:
    stack_, flower = stack
    job_id = submit(stack_, rows(6000))
    wait_for(lambda: tasks(flower, taskname="conveyor.job").get(job_id, {}).get("state")
             == "PROGRESS", 30, "Flower to show the job running")
    response = httpx.delete(f"{stack_.url}/v1/jobs/{job_id}", timeout=10)
    assert response.json()["state"] == "CANCELLED", response.text
    wait_for(lambda: tasks(flower, taskname="conveyor.job")[job_id]["state"] == "REVOKED", 10,
             "Flower to show the cancelled job REVOKED")
    job = tasks(flower, taskname="conveyor.job")[job_id]
    assert job["revoked"] >= job["started"]


def test_the_worker_stats_list_its_models_and_inference_processes(
        stack: tuple[Stack, str]) -> None:
    workers = httpx.get(f"{stack[1]}/api/workers", params={"refresh": "true"}, timeout=30).json()
    [inference] = [w["stats"] for name, w in workers.items() if name.startswith("worker-")]
    assert inference["conveyor_models"] == "echo, picky"
    slots = {k: v for k, v in inference.items() if k.startswith("conveyor_slot ")}
    assert set(slots) == {"conveyor_slot echo/cpu/0", "conveyor_slot picky/cpu/0"}
    for line in slots.values():
        assert re.fullmatch(r"ready, pid \d+, 0 restarts", line), line
    [jobs] = [w["stats"] for name, w in workers.items() if name.startswith("jobs-")]
    assert "conveyor_models" not in jobs


def test_the_queue_page_shows_the_model_streams(stack: tuple[Stack, str]) -> None:
    stack_ = stack[0]

    def echo_streams() -> list[dict[str, Any]]:
        page = httpx.get(f"{stack_.url}/v2/conveyor/queues", timeout=10).json()
        [echo] = [m for m in page["models"] if m["name"] == "echo"]
        streams: list[dict[str, Any]] = echo["streams"]
        return streams

    assert [s["priority"] for s in echo_streams()] == [1, 2, 3]
    job_id = submit(stack_, rows(6000))
    try:
        wait_for(lambda: sum(s["entries"] for s in echo_streams()) > 0, 30,
                 "the job's chunks in echo's streams")
    finally:
        httpx.delete(f"{stack_.url}/v1/jobs/{job_id}", timeout=10)
    wait_for(lambda: sum(s["entries"] for s in echo_streams()) == 0, 30, "the streams to empty")
    page = httpx.get(f"{stack_.url}/v2/conveyor/queues", headers={"accept": "text/html"})
    assert "<h1>Model queues</h1>" in page.text and "<td>picky</td>" in page.text


@pytest.mark.timeout(300)  # with screenshots: some 15 Chromium runs on a busy host
def test_flower_pages_in_a_browser(stack: tuple[Stack, str]) -> None:
    """What a person opening Flower sees: the failed batch, the revoked job, the worker's
    models. Saves the screenshots of docs/jobs.md into ``CONVEYOR_FLOWER_SCREENS``."""
    if browser.CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    stack_, flower = stack
    workers = httpx.get(f"{flower}/api/workers", timeout=30).json()
    [node] = [name for name in workers if name.startswith("worker-")]
    [failed] = [uuid for uuid, t in tasks(flower, taskname="conveyor.batch[picky]").items()
                if t["state"] == "FAILURE"]
    wide, short = (1600, 420), (1400, 560)
    pages = {
        "flower-tasks-failure": (f"{flower}/tasks?state=FAILURE", wide,
                                 ["FAILURE", "conveyor.batch[picky]", "negative row"]),
        "flower-task-failed-batch": (f"{flower}/task/{failed}", (1400, 1000),
                                     ["FAILURE", "Received", "Started", "negative row"]),
        "flower-tasks-jobs": (f"{flower}/tasks?name=conveyor.job", (1600, 540),
                              ["REVOKED", "SUCCESS"]),
        "flower-tasks-batches": (f"{flower}/tasks?name=conveyor.batch[echo]", (1600, 640),
                                 ["batches merged: "]),
        "flower-workers": (f"{flower}/workers", short, [node]),
        "flower-worker": (f"{flower}/worker/{node}#tab-other", short,
                          ["conveyor_models", "conveyor_slot echo/cpu/0"]),
        "conveyor-queues": (f"{stack_.url}/v2/conveyor/queues", short, ["Model queues", "picky"]),
    }
    for url, _, shown in pages.values():
        page = browser.dom(url)
        for text in shown:
            assert html.escape(text, quote=False) in page, (url, text)
    target = os.environ.get("CONVEYOR_FLOWER_SCREENS")
    if not target:
        return
    # The queues page while a job runs shows its chunks waiting; cancelled, it is REVOKED.
    job_id = submit(stack_, rows(6000))
    try:
        wait_for(lambda: tasks(flower, taskname="conveyor.job").get(job_id, {}).get("state")
                 == "PROGRESS", 30, "the job to run")
        url, size, _ = pages.pop("conveyor-queues")
        shoot(Path(target), "conveyor-queues", url, size)
    finally:
        httpx.delete(f"{stack_.url}/v1/jobs/{job_id}", timeout=10)
    wait_for(lambda: tasks(flower, taskname="conveyor.job")[job_id]["state"] == "REVOKED", 10,
             "the job to be revoked")
    for name, (url, size, _) in pages.items():
        shoot(Path(target), name, url, size)


def shoot(folder: Path, name: str, url: str, size: tuple[int, int]) -> None:
    path = folder / f"{name}.png"
    browser.screenshot(url, path, size)
    assert path.stat().st_size < 200_000, f"{path} is too large for the docs"


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
