"""The models a job's chunk goes through: its model, or an ensemble's steps in order.

A job on a model sends each chunk to that model once. A job on an ensemble sends each
chunk through the ensemble's steps one after the other (stage by stage, as the plan
orders them), each step an ordinary request of its step model, carrying the job's
priority (held within that model's levels); the chunk's tensors between steps live in
the job runner only. The job worker reads the plan from the repository as the API does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batching.config import ConfigError, ModelConfig
from batching.ensemble import ensemble_draft, plan_ensemble
from batching.envelope import Tensor
from batching.names import model_folder, require_folder
from batching.repository_scan import load_model_config


@dataclass(frozen=True, slots=True)
class JobStep:
    """One request of a chunk: its model and version, priority, the model's row limit,
    and its tensor maps (the step model's name -> the chunk's; None: as they are)."""

    model: str
    version: str
    priority: int
    max_queue_rows: int
    inputs: dict[str, str] | None = None
    outputs: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class JobRoute:
    """Every step of a chunk, in order, and the job's outputs (None: the last step's as
    it answers them)."""

    steps: tuple[JobStep, ...]
    outputs: tuple[str, ...] | None = None

    def last(self, step: int) -> bool:
        return step == len(self.steps) - 1

    def inputs(self, step: int, tensors: list[Tensor]) -> list[Tensor]:
        """The request's inputs of ``step``, from the chunk's tensors so far."""
        wanted = self.steps[step].inputs
        if wanted is None:
            return tensors
        named = {t.name: t for t in tensors}
        return [Tensor(own, named[given].datatype, named[given].shape, named[given].raw)
                for own, given in wanted.items()]

    def wanted(self, step: int, outputs: list[str]) -> list[str]:
        """The outputs ``step``'s request asks for (``outputs``: the job's, for a model)."""
        mapped = self.steps[step].outputs
        return outputs if mapped is None else list(mapped)

    def answered(self, step: int, tensors: list[Tensor], outputs: list[Tensor]) -> list[Tensor]:
        """The chunk's tensors once ``step`` answered ``outputs``; after the last step, the
        job's outputs."""
        mapped = self.steps[step].outputs
        if mapped is None:
            return outputs
        known = {t.name: t for t in tensors}
        known.update({mapped[t.name]: Tensor(mapped[t.name], t.datatype, t.shape, t.raw)
                      for t in outputs if t.name in mapped})
        if not self.last(step) or self.outputs is None:
            return list(known.values())
        return [known[name] for name in self.outputs if name in known]


def model_route(model: str, priority: int, max_queue_rows: int) -> JobRoute:
    """A job on a model: one request per chunk."""
    return JobRoute((JobStep(model, "", priority, max_queue_rows),))


def read_route(root: Path, model: str, priority: int, max_queue_rows: int,
               outputs: list[str]) -> JobRoute:
    """The route of a job on ``model`` of repository ``root``: an ensemble's steps (its
    plan checked against its step models' configurations), else the model itself.
    ``outputs``: those the job asked for (empty: all the ensemble's)."""
    folder = model_folder(root, model)
    draft = None if folder is None else ensemble_draft(folder)
    if draft is None:
        return model_route(model, priority, max_queue_rows)
    models: dict[str, ModelConfig] = {
        step.model: load_model_config(require_folder(root, step.model)) for step in draft.steps}
    plan = plan_ensemble(draft, models)
    conditional = [step.model for step in plan.steps if step.when is not None]
    if conditional:
        raise ConfigError(f"{model}: step {conditional[0]!r} is conditional; a job runs "
                          "every step of an ensemble on every chunk")
    steps = tuple(
        JobStep(step.model, step.version,
                min(priority, models[step.model].queue.priority_levels),
                models[step.model].queue.partition_rows, dict(step.inputs), dict(step.outputs))
        for stage in plan.stages for step in stage)
    return JobRoute(steps, tuple(outputs or (t.name for t in plan.config.outputs)))
