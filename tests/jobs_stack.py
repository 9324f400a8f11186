"""Shared pieces of the job and Flower tests: job workers, Flower, and job helpers."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tests.conftest import TEST_MODELS, Stack
from tests.procs import Proc, free_port, wait_for

FINISHED = ("SUCCEEDED", "FAILED", "CANCELLED")
PICKY = """
import numpy as np


class Model:
    def __init__(self, config, device):
        pass

    def predict(self, inputs):
        x = inputs["x"]
        if (x[:, 0] < 0).any():
            raise ValueError(f"negative row {x[x[:, 0] < 0][0].tolist()}")
        return {"y": x * 2}
"""
PICKY_CONFIG = ("backend: python\nmax_batch_size: 16\n"
                "inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]\n"
                "outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]\n")
"""``y = 2x``, refusing a batch that holds a row whose first value is negative."""


def echo_and_picky(folder: Path) -> Path:
    """A repository in ``folder``: echo (20 ms a batch) and picky (raises on negative rows)."""
    shutil.copytree(TEST_MODELS / "echo", folder / "models" / "echo")
    (folder / "models" / "picky").mkdir()
    (folder / "models" / "picky" / "model.py").write_text(PICKY)
    (folder / "models" / "picky" / "config.yaml").write_text(PICKY_CONFIG)
    return folder / "models"


def add_job_worker(stack: Stack, threads: int = 2) -> Proc:
    """A job worker (``-Q cv.jobs --no-inference``) of ``stack``, started and ready."""
    name = f"jobs-{stack.prefix}-{len(stack.workers)}"
    proc = Proc(name, [sys.executable, "-m", "celery", "-A", "workers.app", "worker",
                       "-Q", "cv.jobs", "--no-inference", "-P", "threads", "-c", str(threads),
                       "-n", f"{name}@%h", "--without-mingle", "--without-gossip",
                       "--loglevel", "INFO"], stack.env, stack.logdir)
    stack.workers.append(proc)
    wait_for(lambda: " ready." in proc.log(), 30, f"job worker {name}")
    return proc


def start_flower(stack: Stack) -> tuple[Proc, str]:
    port = free_port()
    env = {**stack.env, "FLOWER_UNAUTHENTICATED_API": "true"}
    proc = Proc(f"flower-{stack.prefix}", [sys.executable, "-m", "celery", "-A", "workers.app",
                                          "flower", f"--port={port}", "--address=127.0.0.1"],
                env, stack.logdir)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: httpx.get(f"{url}/healthcheck").status_code == 200, 30, "Flower")
    return proc, url


def rows(count: int, start: float = 0.0) -> np.ndarray:
    """``count`` rows for the echo model: row i is [start + i, 1, 2, 3]."""
    x = np.tile(np.arange(4, dtype=np.float32), (count, 1))
    x[:, 0] = start + np.arange(count, dtype=np.float32)
    return x


def submit(stack: Stack, x: np.ndarray, model: str = "echo", **parameters: Any) -> str:
    body = {"model": model, "parameters": parameters,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}]}
    response = httpx.post(f"{stack.url}/v1/jobs", json=body, timeout=30)
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    assert response.json()["status_url"] == f"/v1/jobs/{job_id}"
    return job_id


def status(stack: Stack, job_id: str) -> dict[str, Any]:
    response = httpx.get(f"{stack.url}/v1/jobs/{job_id}", timeout=10)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def watch(stack: Stack, job_id: str, timeout: float = 60) -> tuple[dict[str, Any], list[int]]:
    """Poll until the job ends; its final status and every ``done`` seen on the way."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = status(stack, job_id)
        seen.append(now["progress"]["done"])
        if now["state"] in FINISHED:
            return now, seen
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not end in {timeout}s: {status(stack, job_id)}")


def wait_done(stack: Stack, job_id: str, at_least: int, timeout: float = 30) -> None:
    wait_for(lambda: status(stack, job_id)["progress"]["done"] >= at_least, timeout,
             f"job {job_id} to pass {at_least} rows")


def result(stack: Stack, job_id: str) -> dict[str, np.ndarray]:
    response = httpx.get(f"{stack.url}/v1/jobs/{job_id}/result", timeout=30)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == job_id and body["model_name"] == status(stack, job_id)["model"]
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in body["outputs"]}
