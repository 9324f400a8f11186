"""The request path end to end: real redis-server, real API and Celery worker processes.

What the API answers by itself (parsing, unknown models, metadata, its metrics) is tested
in-process in tests/unit/test_app_http.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from batching.keys import Keys
from tests.conftest import MakeStack, Stack
from tests.procs import wait_for


def body(values: np.ndarray, **extra: object) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(values.shape),
                        "data": values.ravel().tolist()}], **extra}


def infer(url: str, model: str, payload: dict[str, Any], timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/{model}/infer", json=payload, timeout=timeout)


def output(response: httpx.Response, name: str) -> np.ndarray:
    out = next(o for o in response.json()["outputs"] if o["name"] == name)
    return np.array(out["data"]).reshape(out["shape"])


def test_concurrent_requests_are_batched_and_get_their_own_rows(echo_stack: Stack) -> None:
    rows = [1 + i % 3 for i in range(48)]

    def one(i: int) -> tuple[int, httpx.Response]:
        x = np.full((rows[i], 4), i, dtype=np.float32)
        return i, infer(echo_stack.url, "echo", body(x, id=f"req-{i}"))

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(48)))
    batch_sizes = []
    for i, response in results:
        assert response.status_code == 200, response.text
        assert response.json()["id"] == f"req-{i}"
        np.testing.assert_array_equal(output(response, "y"), np.full((rows[i], 4), 2.0 * i))
        batch_sizes.append(int(output(response, "batch_rows")[0, 0]))
    # The model takes 20 ms per batch, so 16 concurrent clients pile up behind it.
    assert max(batch_sizes) > max(rows)


def test_requested_outputs_only(echo_stack: Stack) -> None:
    response = infer(echo_stack.url, "echo", body(np.ones((1, 4), np.float32),
                                                  outputs=[{"name": "batch_rows"}]))
    assert [o["name"] for o in response.json()["outputs"]] == ["batch_rows"]


def executed(stack: Stack) -> list[float]:
    path = Path(stack.extra_env["ECHO_LOG"])
    return [float(v) for v in path.read_text().split()] if path.exists() else []


def test_expired_requests_get_504_and_never_run(echo_stack: Stack) -> None:
    """The slow model takes 600 ms a batch; a 100 ms request queued behind it expires."""
    marker_busy, marker_late = 7001.0, 7002.0
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(infer, echo_stack.url, "slow",
                           body(np.full((1, 4), marker_busy, np.float32)))
        wait_for(lambda: marker_busy in executed(echo_stack), 10, "the busy batch to start")
        started = time.monotonic()
        late = infer(echo_stack.url, "slow", body(np.full((1, 4), marker_late, np.float32),
                                                  parameters={"timeout": 100_000}))
        waited = time.monotonic() - started
        assert busy.result().status_code == 200
    assert late.status_code == 504, late.text
    assert "deadline" in late.json()["error"]
    assert waited < 0.5
    # Let the worker reach the expired entry: it must answer it without running it.
    follow = infer(echo_stack.url, "slow", body(np.full((1, 4), 7003.0, np.float32)))
    assert follow.status_code == 200
    assert marker_late not in executed(echo_stack)
    queue = echo_stack.redis().xlen(f"{echo_stack.prefix}:{{slow}}:q:2")
    assert queue == 0


def test_an_unreadable_entry_is_dropped_and_releases_its_rows(echo_stack: Stack) -> None:
    client, keys = echo_stack.redis(), Keys(echo_stack.prefix)
    rows_key, stream = keys.rows_waiting("echo"), keys.queue("echo", 2)
    before = int(client.get(rows_key) or 0)
    client.incrby(rows_key, 3)  # as the admission script counts an entry it appends
    client.xadd(stream, {"d": b"\xc1 not a request", "r": 3})
    wait_for(lambda: client.xlen(stream) == 0 and int(client.get(rows_key) or 0) == before,
             10, "the entry to be dropped and its rows released")
    assert infer(echo_stack.url, "echo", body(np.ones((1, 4), np.float32))).status_code == 200


def test_api_processes_sharing_a_multiprocess_dir_report_their_sum(make_stack: MakeStack,
                                                                   tmp_path: Path) -> None:
    stack = make_stack(CONVEYOR_MODELS="echo", PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    first, second = stack.add_api(), stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    for url in (first, first, first, second, second):
        assert infer(url, "echo", body(np.ones((1, 4), np.float32))).status_code == 200
    for url in (first, second):
        text = httpx.get(f"{url}/metrics").text
        assert 'conveyor_requests_total{model="echo",outcome="success"} 5.0' in text
        assert 'conveyor_request_batch_size_count{model="echo"} 5.0' in text
        assert "conveyor_queue_depth{" in text  # the state read from Redis is still there
