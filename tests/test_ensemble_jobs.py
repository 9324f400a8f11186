"""Jobs on ensembles end to end: an API, an inference worker and a job worker over the
ensembles of tests/ensemble_models (Redis real)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import Stack
from tests.jobs_stack import add_job_worker, result, watch
from tests.procs import ROOT, RedisServer
from tests.protocol_stack import PROTOCOL_MODELS

MODELS = ROOT / "tests" / "ensemble_models"
WEIGHTS = np.random.default_rng(3).normal(size=(64, 10)).astype(np.float32)
"""tests/ensemble_models/classify's weights."""


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """add_sub_twice (two steps of simple), pipeline (conditional) and ``chain``: the
    pipeline's three models with no condition."""
    root = tmp_path_factory.mktemp("ensemble-jobs")
    for folder in MODELS.iterdir():
        shutil.copytree(folder, root / folder.name)
    shutil.copytree(PROTOCOL_MODELS / "simple", root / "simple")
    text = (MODELS / "pipeline" / "config.pbtxt").read_text()
    (root / "chain").mkdir()
    (root / "chain" / "config.pbtxt").write_text(
        text.replace('name: "pipeline"', 'name: "chain"').split("parameters {")[0])
    stack = Stack(redis_server.url, root, logdir, extra_env={"CONVEYOR_JOB_CHUNK_ROWS": "8"})
    stack.add_api()
    stack.add_worker()
    add_job_worker(stack)
    try:
        stack.wait_ready(timeout=90)
        yield stack
    finally:
        stack.stop()


def submit(stack: Stack, model: str, inputs: dict[str, np.ndarray], datatype: str,
           outputs: tuple[str, ...] = ()) -> httpx.Response:
    body = {"model": model, "outputs": [{"name": name} for name in outputs],
            "inputs": [{"name": name, "datatype": datatype, "shape": list(array.shape),
                        "data": array.ravel().tolist()} for name, array in inputs.items()]}
    return httpx.post(f"{stack.url}/v1/jobs", json=body, timeout=30)


def test_a_job_on_an_ensemble_runs_each_chunk_through_its_steps(stack: Stack) -> None:
    a = np.arange(50 * 16, dtype=np.int32).reshape(50, 16)
    b = np.full((50, 16), 3, dtype=np.int32)
    answer = submit(stack, "add_sub_twice", {"INPUT0": a, "INPUT1": b}, "INT32")
    assert answer.status_code == 202, answer.text
    final, _ = watch(stack, answer.json()["id"])
    assert final["state"] == "SUCCEEDED", final
    assert final["progress"] == {"done": 50, "total": 50}
    out = result(stack, answer.json()["id"])
    assert sorted(out) == ["OUTPUT0", "OUTPUT1", "SUM"]
    np.testing.assert_array_equal(out["OUTPUT0"], 2 * a)
    np.testing.assert_array_equal(out["OUTPUT1"], 2 * b)
    np.testing.assert_array_equal(out["SUM"], a + b)


def test_a_job_on_a_three_model_ensemble_answers_the_outputs_asked_for(stack: Stack) -> None:
    pixels = np.random.default_rng(5).integers(0, 256, size=(20, 64), dtype=np.uint8)
    answer = submit(stack, "chain", {"IMAGE": pixels}, "UINT8",
                    outputs=("CLASSES",))
    assert answer.status_code == 202, answer.text
    final, _ = watch(stack, answer.json()["id"])
    assert final["state"] == "SUCCEEDED", final
    out = result(stack, answer.json()["id"])
    logits = (pixels.astype(np.float32) / 255.0) @ WEIGHTS
    assert sorted(out) == ["CLASSES"]
    np.testing.assert_array_equal(out["CLASSES"], np.argsort(-logits, axis=1, kind="stable")[:, :3])


def test_a_job_on_a_conditional_ensemble_is_refused(stack: Stack) -> None:
    answer = submit(stack, "pipeline", {"IMAGE": np.zeros((2, 64), np.uint8)}, "UINT8")
    assert answer.status_code == 400
    assert "conditional steps" in answer.json()["error"]
