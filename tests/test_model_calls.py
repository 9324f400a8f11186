"""Models that call other models from ``predict`` end to end: an API and a worker over
tests/bls_models (Redis real)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import Stack
from tests.procs import ROOT, RedisServer
from tests.protocol_stack import copied_repository, protocol_stack

MODELS = ROOT / "tests" / "bls_models"


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """twice, sleepy, caller (one call at a time) and caller_async (two at once)."""
    root = copied_repository(tmp_path_factory.mktemp("bls-repo"), *MODELS.iterdir())
    shutil.copytree(MODELS / "caller", root / "caller_async")
    config = root / "caller_async" / "config.yaml"
    config.write_text(config.read_text().replace("mode: sync", "mode: async"))
    yield from protocol_stack(redis_server, logdir, root)


def infer(stack: Stack, model: str, x: np.ndarray, **parameters: Any) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}], "parameters": parameters}
    return httpx.post(f"{stack.url}/v2/models/{model}/infer", json=body, timeout=30)


def outputs(response: httpx.Response) -> dict[str, np.ndarray]:
    assert response.status_code == 200, response.text
    return {o["name"]: np.array(o["data"]).reshape(o["shape"])
            for o in response.json()["outputs"]}


@pytest.mark.parametrize("model,factor", [("caller", 2), ("caller_async", 4)])
def test_predict_calls_another_model_carrying_the_request_priority(
        stack: Stack, model: str, factor: int) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for priority in (1, 3):
        out = outputs(infer(stack, model, x, priority=priority))
        np.testing.assert_array_equal(out["y"], factor * x)
        assert out["prio"].ravel().tolist() == [priority] * 3


def test_a_called_model_past_the_deadline_answers_504_and_frees_the_caller(
        stack: Stack) -> None:
    late = np.full((1, 4), -1, dtype=np.float32)  # calls sleepy: 4 s a batch
    started = time.monotonic()
    answer = infer(stack, "caller", late, timeout=300_000)
    assert answer.status_code == 504, answer.text
    # The caller's predict gave up at the deadline: its next request is not held 4 s.
    out = outputs(infer(stack, "caller", np.ones((1, 4), np.float32)))
    np.testing.assert_array_equal(out["y"], np.full((1, 4), 2))
    assert time.monotonic() - started < 3.5  # held, it would answer after sleepy: 4 s


def test_a_call_of_itself_is_refused_and_a_called_failure_names_the_model(
        stack: Stack) -> None:
    answer = infer(stack, "caller", np.full((1, 4), -2, dtype=np.float32))
    assert answer.status_code == 500
    assert "'caller' called itself" in answer.json()["error"]
    answer = infer(stack, "caller_async", np.full((1, 4), -3, dtype=np.float32))
    assert answer.status_code == 500
    assert "model 'twice' called from predict failed" in answer.json()["error"]
