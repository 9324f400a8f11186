"""Triton ensembles served in the API process: each step an ordinary request to its model.

A step goes through the same path as a client's request to that model
(:meth:`api.service.InferenceService.infer`), so it batches with every other request of
the model, carries the ensemble request's priority and what is left of its deadline, is
withdrawn when the client leaves (the handler's task is cancelled) and is reclaimed as
any entry is when a worker dies. The steps of a stage run concurrently. Intermediate
tensors live in this request's frame only. The ensemble's own statistics (``/stats``)
are added to its stats hash; each step's are its model's own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from api.dispatch_port import DispatchPort
from api.kserve import InferRequest, Vet
from batching.config import ModelConfig
from batching.ensemble import EnsemblePlan, Step
from batching.envelope import Reply, Tensor
from batching.errors import ConveyorError, DeadlineExceeded, InvalidInput
from batching.keys import Keys
from batching.names import requested_version, unknown_version
from batching.redis_errors import REDIS_FAILED
from batching.signature import check_inputs

log = logging.getLogger(__name__)

Parse = Callable[[ModelConfig, Vet], Awaitable[InferRequest]]


class Steps(Protocol):
    """What the runner asks of the service: its one request path, and its Redis."""

    dispatcher: DispatchPort
    keys: Keys

    async def infer(self, model: str, parse: Parse, started: float, protocol: str,
                    version: str = "", quiet_since: float | None = None
                    ) -> tuple[InferRequest, Reply]: ...


@dataclass(slots=True)
class Ensembles:
    """The ensembles served (name -> checked plan) and their runner."""

    plans: dict[str, EnsemblePlan] = field(default_factory=dict)
    _counts: dict[str, Counter[str]] = field(default_factory=dict)
    """Statistics not yet written: ensemble -> stats hash field -> amount."""
    _writer: asyncio.Task[None] | None = None
    """The one task writing them, while there are some."""

    def ready(self, name: str, model_ready: Callable[[str], bool]) -> bool:
        """An ensemble is ready when every one of its step models is."""
        return all(model_ready(model) for model in self.plans[name].step_models)

    async def infer(self, steps: Steps, name: str, parse: Parse, started: float,
                    protocol: str, version: str = "") -> tuple[InferRequest, Reply]:
        """Parse the ensemble's request, run its steps, answer its outputs (those of a
        step that did not run are absent). A step's error is raised once, its step named."""
        from api.service import requested_priority, timeout_ms_of  # api.service imports this

        plan = self.plans[name]
        number = requested_version(version)
        if number not in (None, 1):
            raise unknown_version(name, number)
        answer = Reply(id="")
        try:
            parsed = await parse(plan.config, lambda _: None)
            if parsed.shm_inputs or parsed.shm_outputs:
                raise InvalidInput(f"ensemble {name!r}: shared memory tensors are not "
                                   "supported with an ensemble")
            deadline = started + timeout_ms_of(parsed.parameters, plan.config) / 1000.0
            priority = requested_priority(parsed, plan.config.queue.priority_levels, 0,
                                          "each step's default")
            tensors = {t.name: t for t in parsed.inputs}
            for stage in plan.stages:
                runs = [step for step in stage if _runs(step, tensors)]
                for outputs in await _together([
                        _step(steps, name, step, tensors, deadline, priority, protocol, answer)
                        for step in runs]):
                    tensors.update(outputs)
            answer.outputs = [tensors[t.name] for t in plan.config.outputs if t.name in tensors]
        except ConveyorError:
            self._record(steps, name, started, ok=False, answer=answer, rows=0)
            raise
        self._record(steps, name, started, ok=True, answer=answer, rows=parsed.rows)
        parsed.version = "1"
        return parsed, answer

    def _record(self, steps: Steps, name: str, started: float, ok: bool, answer: Reply,
                rows: int) -> None:
        """Count the request as Triton counts an ensemble's (its requests and their time,
        the steps' queue and compute times summed); written off the request's path, the
        counts of requests that end during one write added up for the next."""
        counts = self._counts.setdefault(name, Counter())
        outcome = "success" if ok else "fail"
        counts[f"{outcome}_count"] += 1
        counts[f"{outcome}_ns"] += int((time.perf_counter() - started) * 1e9)
        if ok:
            counts.update({"inference_count": rows, "execution_count": 1, "queue_count": 1,
                           "queue_ns": int(answer.queue_ms * 1e6), "compute_infer_count": 1,
                           "compute_infer_ns": int(answer.exec_ms * 1e6)})
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write(steps))

    async def _write(self, steps: Steps) -> None:
        try:
            while self._counts:
                counts, self._counts = self._counts, {}
                await _write_stats(steps, counts)
        finally:
            self._writer = None


def _runs(step: Step, tensors: dict[str, Tensor]) -> bool:
    """A step runs when all its inputs are there and its condition, if any, holds."""
    if not all(tensor in tensors for tensor in step.inputs.values()):
        return False
    if step.when is None:
        return True
    given = tensors.get(step.when.tensor)
    return given is not None and step.when.holds(given.array())


async def _together(calls: list[Awaitable[dict[str, Tensor]]]) -> list[dict[str, Tensor]]:
    """The calls' results; one call is awaited as is, several run at once and, when one
    fails (or the request is cancelled), the others are cancelled."""
    if len(calls) == 1:
        return [await calls[0]]
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def _step(steps: Steps, name: str, step: Step, tensors: dict[str, Tensor],
                deadline: float, priority: int, protocol: str,
                answer: Reply) -> dict[str, Tensor]:
    """One step as a request to its model; its outputs under their ensemble names."""
    left_us = (deadline - time.perf_counter()) * 1e6
    inputs = [Tensor(wanted, tensors[given].datatype, tensors[given].shape,
                     tensors[given].raw) for wanted, given in step.inputs.items()]

    async def parse(config: ModelConfig, vet: Vet) -> InferRequest:
        parameters: dict[str, Any] = {"timeout": max(1.0, left_us)}
        if priority:
            parameters["priority"] = min(priority, config.queue.priority_levels)
        vet(parameters)
        rows = check_inputs(config, [(t.name, t.datatype, t.shape) for t in inputs])
        return InferRequest(None, inputs, rows, list(step.outputs), parameters)

    try:
        if left_us <= 0:
            raise DeadlineExceeded("the request's deadline passed before the step")
        _, reply = await steps.infer(step.model, parse, time.perf_counter(), protocol,
                                     step.version)
    except ConveyorError as exc:
        exc.message = f"ensemble {name!r} step {step.model!r} failed: {exc.message}"
        exc.args = (exc.message,)
        raise
    answer.batch_rows = max(answer.batch_rows, reply.batch_rows)
    answer.queue_ms += reply.queue_ms
    answer.exec_ms += reply.exec_ms
    return {step.outputs[t.name]: Tensor(step.outputs[t.name], t.datatype, t.shape, t.raw)
            for t in reply.outputs if t.name in step.outputs}


async def _write_stats(steps: Steps, counts: dict[str, Counter[str]]) -> None:
    """Add ``counts`` to the ensembles' stats hashes, in one round trip."""
    try:
        pipe = steps.dispatcher.redis.pipeline(transaction=False)
        for name, fields in counts.items():
            key = steps.keys.stats(name)
            for field_name, amount in fields.items():
                pipe.hincrby(key, field_name, amount)
            if fields["execution_count"]:
                pipe.hset(key, "last_inference", int(time.time() * 1000))
        await pipe.execute()
    except REDIS_FAILED as exc:  # statistics only: the requests were answered
        log.warning("ensemble statistics not written: %s", exc)
