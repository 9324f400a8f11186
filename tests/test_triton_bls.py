"""Triton's BLS in a ``TritonPythonModel`` end to end: ``pb_utils.InferenceRequest(...)``
run with ``exec()`` and ``async_exec()`` by tests/bls_models/triton_caller, an API and a
worker over tests/bls_models (Redis real)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from batching import bls
from batching.errors import ModelFailure, ModelNotFound, call_failed
from tests.conftest import Stack
from tests.procs import RedisServer
from tests.protocol_stack import copied_repository, protocol_stack
from tests.test_model_calls import MODELS, infer, outputs
from workers.triton_python import utils_module


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = copied_repository(tmp_path_factory.mktemp("triton-bls-repo"), *MODELS.iterdir())
    yield from protocol_stack(redis_server, logdir, root)


def test_exec_and_async_exec_answer_the_called_models_requested_outputs(
        stack: Stack) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for priority in (1, 3):
        out = outputs(infer(stack, "triton_caller", x, priority=priority))
        np.testing.assert_array_equal(out["y"], 6 * x)
        assert out["prio"].ravel().tolist() == [priority] * 3


@pytest.mark.parametrize("first,message", [
    (-4, "triton_caller: model 'absent' called from predict failed: it cannot be called"),
    (-3, "triton_caller: model 'twice' called from predict failed"),
    (-5, "triton_caller: model 'twice' called: exec(decoupled=True) is not supported"),
])
def test_a_failed_call_is_an_error_response_the_model_answers(
        stack: Stack, first: int, message: str) -> None:
    answer = infer(stack, "triton_caller", np.full((1, 4), first, dtype=np.float32))
    assert answer.status_code == 500, answer.text
    assert message in answer.json()["error"]


class Recorder:
    """A caller of batching/bls.py that answers ``y`` and ``z``, or raises ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.deadlines: list[int] = []

    def call(self, model: str, inputs: Mapping[str, npt.NDArray[Any]], deadline_ms: int,
             priority: int) -> dict[str, npt.NDArray[Any]]:
        self.deadlines.append(deadline_ms)
        if self.error is not None:
            raise self.error
        return {"y": inputs["x"] * 2, "z": inputs["x"]}


def run(caller: Recorder, **keywords: Any) -> Any:
    pb = utils_module()
    request = pb.InferenceRequest(model_name="m", inputs=[pb.Tensor("x", np.ones(2))],
                                  **keywords)
    far = int(time.time() * 1000) + 60_000
    with bls.batch(bls.BatchContext("caller", ((1, far, 1),), caller)):
        return request.exec()


def test_exec_answers_the_requested_outputs_within_its_timeout() -> None:
    caller = Recorder()
    started_ms = time.time() * 1000
    response = run(caller, requested_output_names=["z"], timeout=2_000_000)
    assert not response.has_error()
    assert [t.name() for t in response.output_tensors()] == ["z"]
    assert started_ms + 1_000 < caller.deadlines[0] < started_ms + 30_000
    assert [t.name() for t in run(caller).output_tensors()] == ["y", "z"]
    missing = run(caller, requested_output_names=["w"])
    assert missing.error().message() == "model 'm' has no output 'w'"


def test_a_call_error_is_a_response_with_its_code_and_what_does_not_apply_is_refused() -> None:
    pb = utils_module()
    error = call_failed("m", ModelFailure.code, "it cannot be called")
    error.__cause__ = ModelNotFound("model 'm' not found")
    response = run(Recorder(error))
    assert response.has_error() and response.error().code() == pb.TritonError.NOT_FOUND
    assert "model 'm' called from predict failed" in response.error().message()
    caller = Recorder()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"model_version": 2}, "model_version 2 is not supported"),
        ({"flags": 1}, "sequence flags"), ({"parameters": {"k": 1}}, "request parameters")]
    for keywords, refused in cases:
        answer = run(caller, **keywords).error()
        assert answer.code() == pb.TritonError.UNSUPPORTED and refused in answer.message()
    assert caller.deadlines == [], "a refused call is not made"
