"""Graceful shutdown and the worker's own probes, with real processes."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from tests.conftest import MakeStack, Stack
from tests.procs import wait_for


def started(stack: Stack, value: float) -> bool:
    log = Path(stack.extra_env["ECHO_LOG"])
    return log.exists() and f"{value:g}" in log.read_text().split()


def slow_request(url: str, value: float) -> httpx.Response:
    x = np.full((1, 4), value, np.float32)
    return httpx.post(f"{url}/v2/models/slow/infer", timeout=30, json={"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": x.ravel().tolist()}]})


def test_sigterm_to_the_api_lets_in_flight_requests_finish(make_stack: MakeStack, tmp_path: Path) -> None:
    stack = make_stack(CONVEYOR_MODELS="slow", ECHO_LOG=str(tmp_path / "ran"))
    url = stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    api = stack.apis[0][0]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(slow_request, url, 1.0)  # 600 ms in the model
        wait_for(lambda: started(stack, 1.0), 10, "the request to reach the model")
        api.signal(signal.SIGTERM)
        response = pending.result()
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [2.0] * 4
    wait_for(lambda: not api.alive(), 10, "the API to exit")


def test_sigterm_to_a_worker_finishes_and_acks_the_running_batch(make_stack: MakeStack,
                                                                 tmp_path: Path) -> None:
    stack = make_stack(CONVEYOR_MODELS="slow", ECHO_LOG=str(tmp_path / "ran"))
    url = stack.add_api()
    worker = stack.add_worker()
    stack.wait_ready()
    probe = f"http://127.0.0.1:{worker.probe_port}"
    assert httpx.get(f"{probe}/live").status_code == 200
    assert httpx.get(f"{probe}/ready").json()["slots"][0]["model"] == "slow"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(slow_request, url, 3.0)
        wait_for(lambda: started(stack, 3.0), 10, "the request to reach the model")
        worker.signal(signal.SIGTERM)
        response = pending.result()
    assert response.status_code == 200
    wait_for(lambda: not worker.alive(), 20, "the worker to exit")
    r = stack.redis()
    assert r.xpending(f"{stack.prefix}:{{slow}}:q:2", "workers")["pending"] == 0
    assert r.hlen(f"{stack.prefix}:{{slow}}:workers") == 0


def test_worker_probe_reports_readiness_of_its_processes(make_stack: MakeStack) -> None:
    stack = make_stack(CONVEYOR_MODELS="echo")
    stack.add_api()
    worker = stack.add_worker()
    probe = f"http://127.0.0.1:{worker.probe_port}"
    wait_for(lambda: httpx.get(f"{probe}/live").status_code == 200, 30, "the worker probe")
    wait_for(lambda: httpx.get(f"{probe}/ready").status_code == 200, 30, "worker readiness")
    assert httpx.get(f"{probe}/nope").status_code == 404
