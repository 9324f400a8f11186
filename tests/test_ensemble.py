"""Triton ensembles end to end: an API and a worker over tests/ensemble_models (Redis real)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Stack
from tests.procs import ROOT, RedisServer, wait_for
from tests.protocol_stack import PROTOCOL_MODELS, copied_repository, grpc_url, http_host, protocol_stack

MODELS = ROOT / "tests" / "ensemble_models"
WEIGHTS = np.random.default_rng(3).normal(size=(64, 10)).astype(np.float32)
"""tests/ensemble_models/classify's weights."""


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = copied_repository(tmp_path_factory.mktemp("ensemble-repo"), *MODELS.iterdir(),
                             PROTOCOL_MODELS / "simple")
    (root / "broken").mkdir()  # its first step's model is not in the repository
    text = (MODELS / "add_sub_twice" / "config.pbtxt").read_text()
    (root / "broken" / "config.pbtxt").write_text(
        text.replace('"add_sub_twice"', '"broken"')
        .replace('model_name: "simple"', 'model_name: "missing"', 1))
    yield from protocol_stack(redis_server, logdir, root, CONVEYOR_HEARTBEAT_STALE_S="2")


def add_sub_inputs(module: Any, a: np.ndarray, b: np.ndarray, binary: bool) -> list[Any]:
    inputs = [module.InferInput("INPUT0", list(a.shape), "INT32"),
              module.InferInput("INPUT1", list(b.shape), "INT32")]
    for item, array in zip(inputs, (a, b), strict=True):
        if module is httpclient:
            item.set_data_from_numpy(array, binary_data=binary)
        else:
            item.set_data_from_numpy(array)
    return inputs


@pytest.mark.parametrize("binary", [False, True])
def test_triton_simple_style_ensemble_over_http(stack: Stack, binary: bool) -> None:
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 3, dtype=np.int32)
    with httpclient.InferenceServerClient(http_host(stack)) as client:
        result = client.infer("add_sub_twice", add_sub_inputs(httpclient, a, b, binary),
                              outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary),
                                       httpclient.InferRequestedOutput("OUTPUT1", binary)])
        assert np.array_equal(result.as_numpy("OUTPUT0"), 2 * a)
        assert np.array_equal(result.as_numpy("OUTPUT1"), 2 * b)
        assert result.as_numpy("SUM") is None  # not asked for
        every = client.infer("add_sub_twice", add_sub_inputs(httpclient, a, b, binary))
        assert np.array_equal(every.as_numpy("SUM"), a + b)
        assert client.is_model_ready("add_sub_twice")
        metadata = client.get_model_metadata("add_sub_twice")
        assert metadata["platform"] == "ensemble"
        assert [t["name"] for t in metadata["inputs"]] == ["INPUT0", "INPUT1"]
        config = client.get_model_config("add_sub_twice")
        assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == ["simple"] * 2


def test_ensemble_over_grpc(stack: Stack) -> None:
    a = np.ones((1, 16), dtype=np.int32)
    b = np.arange(16, dtype=np.int32).reshape(1, 16)
    client = grpcclient.InferenceServerClient(grpc_url(stack))
    try:
        result = client.infer("add_sub_twice", add_sub_inputs(grpcclient, a, b, True))
        assert np.array_equal(result.as_numpy("OUTPUT0"), 2 * a)
        assert client.is_model_ready("add_sub_twice")
        assert client.get_model_metadata("add_sub_twice").platform == "ensemble"
        assert client.get_model_config("add_sub_twice").config.platform == "ensemble"
        names = [s.name for s in client.get_inference_statistics().model_stats]
        assert "add_sub_twice" in names
    finally:
        client.close()


def image(bright: bool, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(129 if bright else 0, 256 if bright else 100, size=(1, 64),
                        dtype=np.uint8)


def pipeline(url: str, pixels: np.ndarray, **parameters: Any) -> httpx.Response:
    body = {"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": list(pixels.shape),
                        "data": pixels.ravel().tolist()}], "parameters": parameters}
    return httpx.post(f"{url}/v2/models/pipeline/infer", json=body, timeout=30)


def stats(url: str, model: str) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"{url}/v2/models/{model}/stats").json()["model_stats"][0]
    return found


def test_three_step_pipeline_batches_each_step_under_load(stack: Stack) -> None:
    images = [image(True, seed) for seed in range(64)]
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda pixels: pipeline(stack.url, pixels), images))
    for pixels, answer in zip(images, answers, strict=True):
        assert answer.status_code == 200, answer.text
        outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
        logits = (pixels.astype(np.float32) / 255.0) @ WEIGHTS
        assert outputs["CLASSES"] == np.argsort(-logits[0], kind="stable")[:3].tolist()
        assert outputs["BRIGHT"] == [64]
    classify = stats(stack.url, "classify")
    assert classify["inference_count"] >= 64
    assert classify["inference_count"] / classify["execution_count"] > 1  # batched
    assert max(b["batch_size"] for b in classify["batch_stats"]) > 1

    def counted() -> bool:
        return bool(stats(stack.url, "pipeline")["inference_stats"]["success"]["count"] >= 64)

    wait_for(counted, 10, "the ensemble's own statistics")
    assert stats(stack.url, "pipeline")["inference_count"] >= 64


def test_a_conditional_step_that_does_not_run_leaves_its_outputs_out(stack: Stack) -> None:
    before = stats(stack.url, "classify")["inference_count"]
    answer = pipeline(stack.url, image(False, 1))
    assert answer.status_code == 200, answer.text
    assert {o["name"]: o["data"] for o in answer.json()["outputs"]} == {"BRIGHT": [0]}
    assert stats(stack.url, "classify")["inference_count"] == before


def test_a_failed_step_answers_once_naming_the_step(stack: Stack) -> None:
    late = pipeline(stack.url, image(True, 2), timeout=1)  # 1 µs: gone before any step
    assert late.status_code == 504
    assert late.json()["error"].startswith("ensemble 'pipeline' step 'decode' failed: ")
    wrong = httpx.post(f"{stack.url}/v2/models/pipeline/infer", json={"inputs": [
        {"name": "IMAGE", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}]})
    assert wrong.status_code == 400 and "IMAGE" in wrong.json()["error"]


def test_unknown_ensemble_version_is_not_found(stack: Stack) -> None:
    with httpclient.InferenceServerClient(http_host(stack)) as client, \
            pytest.raises(InferenceServerException, match="version 2"):
        client.infer("add_sub_twice", add_sub_inputs(httpclient, np.ones((1, 16), np.int32),
                                                     np.ones((1, 16), np.int32), False),
                     model_version="2")


def test_the_index_shows_ensembles_and_a_load_refuses_one(stack: Stack) -> None:
    index = {e["name"]: e for e in httpx.post(f"{stack.url}/v2/repository/index").json()}
    assert index["add_sub_twice"]["state"] == "READY"
    assert index["pipeline"]["state"] == "READY"
    assert index["broken"]["state"] == "UNAVAILABLE"
    assert index["broken"]["reason"] == ("broken: ensemble step 'missing': model 'missing' is "
                                         "not loaded (not in the repository, or unavailable; "
                                         "an ensemble is no step)")
    refused = httpx.post(f"{stack.url}/v2/repository/models/add_sub_twice/load")
    assert refused.status_code == 400
    assert "an ensemble is no model of its own" in refused.json()["error"]
    assert httpx.get(f"{stack.url}/v2/models/add_sub_twice/ready").status_code == 200


def test_a_step_whose_inference_process_is_killed_is_answered(stack: Stack) -> None:
    """Run last: it kills classify's inference process under load; every pipeline is
    still answered, its classify step reclaimed as any request is."""
    beats = cast(dict[bytes, bytes],
                 stack.redis().hgetall(f"{stack.prefix}:{{classify}}:workers"))
    pids = [json.loads(v)["pid"] for k, v in beats.items()
            if not k.endswith(b":slot") and json.loads(v).get("state") == "ready"]
    assert pids
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(pipeline, stack.url, image(True, seed)) for seed in range(200)]
        wait_for(lambda: sum(f.done() for f in futures) >= 30, 60, "pipelines under way")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        answers = [f.result() for f in futures]
    failed = [a.text for a in answers if a.status_code != 200]
    assert not failed, failed[:3]
