"""Readiness follows worker heartbeats; liveness never depends on them."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from tests.conftest import MakeStack
from tests.procs import wait_for


def test_readiness_false_without_worker_true_after_and_false_again(make_stack: MakeStack) -> None:
    stack = make_stack(CONVEYOR_MODELS="echo")
    url = stack.add_api()
    assert httpx.get(f"{url}/v2/health/live").status_code == 200
    assert httpx.get(f"{url}/v2/health/ready").status_code == 503
    assert httpx.get(f"{url}/v2/models/echo/ready").status_code == 503
    # With no worker at all, infer fails fast instead of waiting for the deadline.
    response = httpx.post(f"{url}/v2/models/echo/infer", json={"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 0, 0, 0]}]})
    assert response.status_code == 503 and "no worker" in response.json()["error"]

    worker = stack.add_worker()
    stack.wait_ready()
    assert httpx.get(f"{url}/v2/models/echo/ready").status_code == 200

    worker.stop()
    wait_for(lambda: httpx.get(f"{url}/v2/health/ready").status_code == 503, 15,
             "readiness to drop after the worker stopped")
    assert httpx.get(f"{url}/v2/health/live").status_code == 200
    assert stack.redis().hlen(f"{stack.prefix}:{{echo}}:workers") == 0


def test_never_ready_with_zero_models(make_stack: MakeStack, tmp_path: Path) -> None:
    stack = make_stack(repository=tmp_path)
    url = stack.add_api()
    assert httpx.get(f"{url}/v2/health/ready").status_code == 503


def test_two_apis_and_two_workers_share_the_streams(make_stack: MakeStack) -> None:
    stack = make_stack(CONVEYOR_MODELS="echo")
    urls = [stack.add_api(), stack.add_api()]
    stack.add_worker()
    stack.add_worker()
    stack.wait_ready()
    wait_for(lambda: stack.redis().hlen(f"{stack.prefix}:{{echo}}:workers") == 2, 30,
             "both workers' echo processes")

    def one(i: int) -> tuple[int, httpx.Response]:
        x = np.full((1, 4), i, dtype=np.float32)
        return i, httpx.post(f"{urls[i % 2]}/v2/models/echo/infer", timeout=30, json={
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                        "data": x.ravel().tolist()}]})

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(64)))
    for i, response in results:
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["data"] == [2.0 * i] * 4
    consumers = stack.redis().xinfo_consumers(f"{stack.prefix}:{{echo}}:q:2", "workers")
    assert len(consumers) == 2
