"""/metrics against a real stack: what each metric says matches what happened.

The stuck-queue test stops the only worker of a slow model, queues requests for it, and
starts another: the requests wait (in flight, oldest unread entry ageing, drain time
+Inf), then run in batches whose sizes the replies report, so the per-batch histograms
can be checked against them exactly.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batching.keys import Keys
from tests.conftest import TEST_MODELS, MakeStack, Stack
from tests.jobs_stack import add_job_worker, rows, submit, watch
from tests.procs import RedisServer, wait_for
from tests.test_infer import body, infer, output

SLOW_CONFIG = """backend: python
max_batch_size: 8
inputs:
  - {name: x, datatype: FP32, shape: [-1, 4]}
outputs:
  - {name: y, datatype: FP32, shape: [-1, 4]}
  - {name: batch_rows, datatype: INT64, shape: [-1, 1]}
queue:
  default_timeout_ms: 120000
parameters:
  delay_ms: 600
"""
"""The slow test model, waiting up to two minutes in the queue: a worker may take long to
start on a busy host."""
QUEUED = 16


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a scrape, by name and labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, got), v in samples.items() if n == name and want <= got)


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An API and a worker serving echo and the slow model (the stuck-queue test, last,
    replaces the worker)."""
    repository = tmp_path_factory.mktemp("models")
    shutil.copytree(TEST_MODELS / "echo", repository / "echo")
    (repository / "slow").mkdir()
    shutil.copy(TEST_MODELS / "slow" / "model.py", repository / "slow" / "model.py")
    (repository / "slow" / "config.yaml").write_text(SLOW_CONFIG)
    stack = Stack(redis_server.url, repository, logdir)
    stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    yield stack
    stack.stop()


def test_latency_is_labelled_by_outcome_and_http_code(stack: Stack) -> None:
    assert infer(stack.url, "echo", body(np.ones((1, 4), np.float32))).status_code == 200
    assert infer(stack.url, "echo", {"inputs": []}).status_code == 400
    samples = scrape(stack.url)
    name = "conveyor_request_duration_seconds_count"
    assert value(samples, name, model="echo", outcome="success", code="200") == 1
    assert value(samples, name, model="echo", outcome="invalid_input", code="400") == 1
    assert value(samples, "conveyor_request_duration_seconds_bucket", model="echo",
                 outcome="invalid_input", code="400", le="+Inf") == 1


def test_head_metrics_answers_the_headers_without_a_body(stack: Stack) -> None:
    response = httpx.head(f"{stack.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert int(response.headers["content-length"]) > 1000
    assert response.content == b""


def test_instance_states_and_resident_memory_come_from_heartbeats(stack: Stack) -> None:
    def ready() -> bool:
        return total(scrape(stack.url), "conveyor_model_instance_state", model="slow",
                     state="ready") == 1
    wait_for(ready, 30, "the slow model's process to show ready")
    samples = scrape(stack.url)
    assert total(samples, "conveyor_model_instance_state", model="slow", state="loading") == 0
    assert (value(samples, "conveyor_process_resident_memory_bytes", role="api", model="",
                  consumer="") or 0) > 10e6
    workers = [v for (n, labels), v in samples.items()
               if n == "conveyor_process_resident_memory_bytes"
               and ("role", "worker") in labels and ("model", "slow") in labels]
    assert len(workers) == 1 and workers[0] > 10e6


def test_a_stuck_queue_then_batches_observed_once_each(stack: Stack) -> None:
    url = stack.url
    stack.workers[0].stop()
    wait_for(lambda: total(scrape(url), "conveyor_model_instance_state", model="slow") == 0,
             30, "the stopped worker's heartbeats to go")
    x = np.ones((1, 4), np.float32)
    with ThreadPoolExecutor(QUEUED) as pool:
        replies = [pool.submit(infer, url, "slow", body(x), 180) for _ in range(QUEUED)]

        def stuck() -> bool:
            samples = scrape(url)
            return (value(samples, "conveyor_requests_in_flight", model="slow") == QUEUED
                    and total(samples, "conveyor_queue_depth", model="slow") == QUEUED
                    and total(samples, "conveyor_queue_oldest_age_seconds", model="slow") > 0.5)
        wait_for(stuck, 30, f"{QUEUED} requests in flight, queued and ageing")
        assert value(scrape(url), "conveyor_queue_drain_seconds", model="slow") == math.inf
        stack.add_worker()
        answered = [r.result() for r in replies]
    assert all(r.status_code == 200 for r in answered), [r.text for r in answered]
    sizes = [int(output(r, "batch_rows")[0, 0]) for r in answered]
    batches = round(sum(1 / n for n in sizes))  # a batch of n one-row requests: n replies
    assert batches < QUEUED, "the queued requests should have shared batches"

    samples = scrape(url)
    assert value(samples, "conveyor_batch_size_count", model="slow") == batches
    assert value(samples, "conveyor_batch_size_sum", model="slow") == QUEUED
    for le in ("1.0", "2.0", "4.0", "8.0"):
        assert value(samples, "conveyor_batch_size_bucket", model="slow", le=le) == round(
            sum(1 / n for n in sizes if n <= float(le)))
    assert value(samples, "conveyor_request_batch_size_count", model="slow") == QUEUED
    assert value(samples, "conveyor_request_batch_size_sum", model="slow") == sum(sizes)
    assert value(samples, "conveyor_rows_total", model="slow") == QUEUED
    assert value(samples, "conveyor_batch_execution_seconds_count", model="slow") == batches
    assert value(samples, "conveyor_batch_execution_seconds_bucket", model="slow",
                 le="0.5") == 0  # each batch sleeps 0.6 s
    assert value(samples, "conveyor_batch_execution_seconds_bucket", model="slow",
                 le="+Inf") == batches
    assert (value(samples, "conveyor_batch_execution_seconds_sum", model="slow") or 0) >= (
        0.6 * batches)
    assert value(samples, "conveyor_requests_in_flight", model="slow") == 0
    assert value(samples, "conveyor_queue_drain_seconds", model="slow") == 0
    assert total(samples, "conveyor_queue_oldest_age_seconds", model="slow") == 0

    keys = Keys(stack.prefix)
    with stack.redis() as client:
        def served() -> bool:
            beats = [json.loads(b) for b in client.hvals(keys.workers("slow"))]
            return any(b.get("service_rows_per_s", 0) > 0 for b in beats)
        wait_for(served, 30, "a heartbeat with the rows per second the process serves")


def test_job_counts_follow_each_state_change(make_stack: MakeStack) -> None:
    # A long lease: the job workers' recount (every lease / 2) must not be what is seen.
    stack = make_stack(CONVEYOR_MODELS="echo", CONVEYOR_JOB_LEASE_S="600")
    stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    waiting = submit(stack, rows(5))
    assert value(scrape(stack.url), "conveyor_jobs", state="PENDING") == 1
    assert httpx.delete(f"{stack.url}/v1/jobs/{waiting}").status_code == 200
    samples = scrape(stack.url)
    assert value(samples, "conveyor_jobs", state="PENDING") == 0
    assert value(samples, "conveyor_jobs_finished_total", state="CANCELLED") == 1
    add_job_worker(stack)
    done, _ = watch(stack, submit(stack, rows(20)))
    assert done["state"] == "SUCCEEDED"
    samples = scrape(stack.url)
    assert value(samples, "conveyor_jobs", state="PENDING") == 0
    assert value(samples, "conveyor_jobs", state="RUNNING") == 0
    assert value(samples, "conveyor_jobs_finished_total", state="SUCCEEDED") == 1
    assert value(samples, "conveyor_jobs_finished_total", state="FAILED") == 0
    assert value(samples, "conveyor_job_rows_total", model="echo") == 20


def test_job_workers_recount_a_job_that_expired_before_it_ran(make_stack: MakeStack) -> None:
    stack = make_stack(CONVEYOR_MODELS="echo", CONVEYOR_JOB_LEASE_S="1")
    stack.add_api()
    job = submit(stack, rows(5))
    assert value(scrape(stack.url), "conveyor_jobs", state="PENDING") == 1
    with stack.redis() as client:
        client.delete(Keys(stack.prefix).job(job))  # as its TTL would
    add_job_worker(stack)
    wait_for(lambda: value(scrape(stack.url), "conveyor_jobs", state="PENDING") == 0, 30,
             "the job workers to recount the pending jobs")
