"""The ensemble runner (api/ensemble.py) over a stand-in service: no Redis, no worker."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any, cast

import numpy as np
import pytest

from api.ensemble import Ensembles, Parse
from api.kserve import InferRequest
from batching.config import ModelConfig, QueueConfig, TensorSpec
from batching.ensemble import plan_ensemble, read_ensemble
from batching.envelope import Reply, Tensor
from batching.errors import ConveyorError, Overloaded
from batching.keys import Keys

SPEC = (TensorSpec("x", "FP32", (-1, 2)),)
MODELS = {name: ModelConfig(name, "python", 8, SPEC, (TensorSpec("y", "FP32", (-1, 2)),),
                            queue=QueueConfig(priority_levels=levels))
          for name, levels in (("double", 3), ("negate", 2), ("slow", 3))}
ENSEMBLE = b'''
name: "ens" platform: "ensemble" max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "D" data_type: TYPE_FP32 dims: [ 2 ] },
         { name: "N" data_type: TYPE_FP32 dims: [ 2 ] },
         { name: "S" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling { step [
  { model_name: "double" input_map { key: "x" value: "IN" } output_map { key: "y" value: "D" } },
  { model_name: "negate" input_map { key: "x" value: "IN" } output_map { key: "y" value: "N" } },
  { model_name: "slow" input_map { key: "x" value: "D" } output_map { key: "y" value: "S" } }
] }
parameters { key: "conveyor.when:slow" value { string_value: "D > 0" } }
'''


def synchronous(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """The async test run to its end on a loop of its own."""
    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())
    return run


class Pipe:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    def hincrby(self, *args: Any) -> None:
        self.log.append(("hincrby", *args))

    def hset(self, *args: Any) -> None:
        self.log.append(("hset", *args))

    async def execute(self) -> list[Any]:
        return []


class Steps:
    """The service's request path, with each model's step as plain numpy."""

    def __init__(self, fail: str = "") -> None:
        self.keys = Keys("t")
        self.writes: list[tuple[Any, ...]] = []
        self.dispatcher = self
        self.redis = self
        self.seen: dict[str, dict[str, Any]] = {}
        self.running: set[str] = set()
        self.overlapped = False
        self.cancelled: list[str] = []
        self.fail = fail
        self.gate = asyncio.Event()

    def pipeline(self, transaction: bool) -> Pipe:
        return Pipe(self.writes)

    async def infer(self, model: str, parse: Parse, started: float, protocol: str,
                    version: str = "", quiet_since: float | None = None
                    ) -> tuple[InferRequest, Reply]:
        parsed = await parse(MODELS[model], lambda _: None)
        self.seen[model] = dict(parsed.parameters)
        self.running.add(model)
        self.overlapped |= self.running >= {"double", "negate"}
        try:
            await asyncio.sleep(0.01)
            if model == "slow":
                await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(model)
            raise
        finally:
            self.running.discard(model)
        if model == self.fail:
            raise Overloaded("the model's queue is full", retry_after_s=3)
        x = parsed.inputs[0].array()
        y = {"double": 2 * x, "negate": -x, "slow": x + 1}[model]
        return parsed, Reply("r", [Tensor.from_array("y", y)], batch_rows=4, queue_ms=1.0)


def ensembles() -> Ensembles:
    return Ensembles({"ens": plan_ensemble(read_ensemble("ens", ENSEMBLE), MODELS)})


def serve(steps: Steps, name: str, parse: Parse, started: float,
          protocol: str) -> Coroutine[Any, Any, tuple[InferRequest, Reply]]:
    """The runner's infer with the stand-in (typed as the service it stands in for)."""
    return ensembles().infer(cast(Any, steps), name, parse, started, protocol)


def request(values: list[float], **parameters: Any) -> Parse:
    async def parse(config: ModelConfig, vet: Any) -> InferRequest:
        tensor = Tensor.from_array("IN", np.array([values], dtype=np.float32))
        return InferRequest("id-1", [tensor], 1, parameters=parameters)
    return parse


def outputs(reply: Reply) -> dict[str, list[float]]:
    return {t.name: t.array().ravel().tolist() for t in reply.outputs}


@synchronous
async def test_steps_run_in_stages_and_carry_deadline_and_priority() -> None:
    steps = Steps()
    steps.gate.set()
    parsed, reply = await serve(steps, "ens", request([1, 2], priority=3, timeout=5_000_000),
                                time.perf_counter(), "http")
    assert outputs(reply) == {"D": [2, 4], "N": [-1, -2], "S": [3, 5]}
    assert steps.overlapped  # double and negate, one stage, ran at once
    assert steps.seen["double"]["priority"] == 3 and steps.seen["negate"]["priority"] == 2
    assert steps.seen["slow"]["timeout"] < steps.seen["double"]["timeout"] <= 5_000_000
    assert parsed.id == "id-1" and reply.queue_ms == 3.0 and reply.batch_rows == 4
    await asyncio.sleep(0)
    assert ("hincrby", "t:{ens}:stats", "success_count", 1) in steps.writes


@synchronous
async def test_a_condition_that_does_not_hold_leaves_the_step_out() -> None:
    steps = Steps()
    _, reply = await serve(steps, "ens", request([-1, -2]), time.perf_counter(), "http")
    assert outputs(reply) == {"D": [-2, -4], "N": [1, 2]}
    assert "slow" not in steps.seen


@synchronous
async def test_a_failed_step_is_named_and_its_error_kept() -> None:
    steps = Steps(fail="negate")
    with pytest.raises(Overloaded) as caught:
        await serve(steps, "ens", request([1, 1]), time.perf_counter(), "grpc")
    assert caught.value.message == ("ensemble 'ens' step 'negate' failed: the model's queue "
                                    "is full")
    assert caught.value.retry_after_s == 3 and "slow" not in steps.seen
    await asyncio.sleep(0)
    assert ("hincrby", "t:{ens}:stats", "fail_count", 1) in steps.writes


@synchronous
async def test_a_client_that_leaves_cancels_the_step_in_flight() -> None:
    steps = Steps()
    task = asyncio.create_task(serve(steps, "ens", request([1, 1]), time.perf_counter(),
                                     "http"))

    async def slow_started() -> None:
        while "slow" not in steps.running:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(slow_started(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps.cancelled == ["slow"]


@synchronous
async def test_the_deadline_gone_before_a_step_answers_without_running_it() -> None:
    steps = Steps()
    with pytest.raises(ConveyorError, match="ensemble 'ens' step 'double' failed: the "
                                            "request's deadline passed"):
        await serve(steps, "ens", request([1, 1], timeout=1), time.perf_counter() - 1, "http")
    assert steps.seen == {}
