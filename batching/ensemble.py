"""Triton ensembles: ``config.pbtxt``'s ``ensemble_scheduling`` read into a checked plan.

:func:`read_ensemble` reads the configuration (its own fields only); :func:`plan_ensemble`
checks it against the loaded step models and orders the steps. Every refusal is one
:class:`ConfigError` naming the ensemble, the step and the tensor. The API runs the plan
(api/ensemble.py): each step is an ordinary request to its step's model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from batching.config import ConfigError, ModelConfig, QueueConfig, TensorSpec
from batching.ensemble_when import Condition, read_condition
from batching.triton_repository import (
    ENSEMBLE,
    Fields,
    is_ensemble,
    pbtxt_fields,
    tensor_entry,
)

WHEN = "conveyor.when:"
"""An ensemble ``parameters`` key ``conveyor.when:<step model>``: that step's condition."""


@dataclass(frozen=True, slots=True)
class Step:
    """One step: its model, the version asked for ("" is the newest), its inputs
    (the step model's input -> ensemble tensor) and outputs (step output -> ensemble
    tensor), and the condition under which it runs (None: always)."""

    model: str
    version: str
    inputs: dict[str, str]
    outputs: dict[str, str]
    when: Condition | None = None


@dataclass(frozen=True, slots=True)
class EnsembleDraft:
    """An ensemble's configuration as read, not yet checked against its step models."""

    name: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    steps: tuple[Step, ...]


@dataclass(frozen=True, slots=True)
class EnsemblePlan:
    """A checked ensemble: its signature as a model (``backend`` "ensemble"), its steps
    as written, and the same in stages: every step of a stage needs only tensors of
    earlier stages."""

    config: ModelConfig
    steps: tuple[Step, ...]
    stages: tuple[tuple[Step, ...], ...]
    step_models: frozenset[str] = field(default_factory=frozenset)


def ensemble_draft(folder: Path) -> EnsembleDraft | None:
    """The ensemble that the ``config.pbtxt`` of model folder ``folder`` configures; None
    when it configures none (or there is none)."""
    pbtxt = folder / "config.pbtxt"
    if not pbtxt.is_file():
        return None
    try:
        text = pbtxt.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{folder.name}: config.pbtxt cannot be read ({exc.strerror})") from None
    if not is_ensemble(pbtxt_fields(folder.name, text)):
        return None
    return read_ensemble(folder.name, text)


def read_ensemble(model: str, text: bytes) -> EnsembleDraft:
    """The ensemble that ``config.pbtxt`` (its bytes) configures."""
    top = pbtxt_fields(model, text)
    name = top.string("name")
    if name is not None and name != model:
        raise top.error(top.message.line, f"name {name!r} is not the model folder's name "
                                          f"{model!r}")
    if top.string("platform") != ENSEMBLE:
        raise top.error(top.message.line, 'platform must be "ensemble"')
    batch = top.integer("max_batch_size") or 0
    tensors = {}
    for key, field_name in (("inputs", "input"), ("outputs", "output")):
        specs = []
        for entry in top.messages(field_name):
            raw = tensor_entry(entry, batch > 0)
            if "reshape" in raw:
                raise entry.error(entry.message.line, "reshape is not supported in an "
                                                      "ensemble's own tensors")
            specs.append(TensorSpec(raw["name"], raw["datatype"], tuple(raw["shape"])))
        tensors[key] = tuple(specs)
    scheduling = top.sub("ensemble_scheduling")
    if scheduling is None:
        raise top.error(top.message.line, "ensemble_scheduling is required")
    steps = [_step(entry) for entry in scheduling.messages("step")]
    scheduling.done()
    if not steps:
        raise scheduling.error(scheduling.message.line, "an ensemble needs at least one step")
    conditions = _conditions(top, steps)
    top.done()
    steps = [Step(s.model, s.version, s.inputs, s.outputs, conditions.get(s.model))
             for s in steps]
    return EnsembleDraft(model, batch, tensors["inputs"], tensors["outputs"], tuple(steps))


def _step(fields: Fields) -> Step:
    model = fields.string("model_name")
    if not model:
        raise fields.error(fields.message.line, "model_name is required")
    fields.where += f"{model!r}: "
    version = fields.integer("model_version")
    maps = {}
    for name in ("input_map", "output_map"):
        pairs: dict[str, str] = {}
        for entry in fields.messages(name):
            key, value = entry.string("key"), entry.string("value")
            entry.done()
            if not key or not value:
                raise entry.error(entry.message.line, "an entry needs a key and a value")
            if key in pairs:
                raise entry.error(entry.message.line, f"{key!r} is mapped twice")
            pairs[key] = value
        maps[name] = pairs
    fields.done()
    if not maps["output_map"]:
        raise fields.error(fields.message.line, "output_map is required")
    return Step(model, "" if version is None or version < 0 else str(version),
                maps["input_map"], maps["output_map"])


def _conditions(top: Fields, steps: list[Step]) -> dict[str, Condition]:
    """``parameters { key: "conveyor.when:<step model>" value { string_value: "..." } }``."""
    conditions: dict[str, Condition] = {}
    for entry in top.messages("parameters"):
        key = entry.string("key") or ""
        value = entry.sub("value")
        entry.done()
        text = None if value is None else value.string("string_value")
        if value is not None:
            value.done()
        if not key.startswith(WHEN) or text is None:
            raise entry.error(entry.message.line, f"parameter {key!r} is not supported on "
                                                  f"an ensemble (only {WHEN}<step model>)")
        model = key[len(WHEN):]
        runs = sum(step.model == model for step in steps)
        if runs != 1:
            raise entry.error(entry.message.line, f"{key}: {runs} steps run model {model!r} "
                                                  "(a condition names exactly one step)")
        try:
            conditions[model] = read_condition(text)
        except ValueError as exc:
            raise entry.error(entry.message.line, f"{key}: {exc}") from None
    return conditions


def plan_ensemble(draft: EnsembleDraft, models: Mapping[str, ModelConfig]) -> EnsemblePlan:
    """``draft`` checked against the loaded ``models`` and ordered."""
    where = f"{draft.name}: ensemble"
    produced: dict[str, TensorSpec] = {t.name: t for t in draft.inputs}
    producer: dict[str, int] = {}
    configs = [_step_model(where, step, draft, models) for step in draft.steps]
    for index, (step, config) in enumerate(zip(draft.steps, configs, strict=True)):
        for output, tensor in step.outputs.items():
            spec = _spec(where, step, config.outputs, output, "output")
            if tensor in produced:
                raise ConfigError(f"{where} step {step.model!r}: output {output!r} maps to "
                                  f"{tensor!r}, which another step or the ensemble's input "
                                  "already gives")
            produced[tensor], producer[tensor] = spec, index
    needs: list[set[int]] = []
    for step, config in zip(draft.steps, configs, strict=True):
        missing = [t.name for t in config.inputs if t.name not in step.inputs]
        if missing:
            raise ConfigError(f"{where} step {step.model!r}: input {missing[0]!r} of model "
                              f"{step.model!r} is not mapped (input_map)")
        wanted = [(spec_name, tensor) for spec_name, tensor in step.inputs.items()]
        if step.when is not None:
            wanted.append(("", step.when.tensor))
        for input_name, tensor in wanted:
            if tensor not in produced:
                raise ConfigError(f"{where} step {step.model!r}: {tensor!r} is neither an "
                                  "input of the ensemble nor an output of a step")
            if input_name:
                spec = _spec(where, step, config.inputs, input_name, "input")
                _match(f"{where} step {step.model!r}: input {input_name!r}", spec,
                       produced[tensor], tensor)
            elif produced[tensor].datatype == "BYTES":
                raise ConfigError(f"{where} step {step.model!r}: its condition's tensor "
                                  f"{tensor!r} is BYTES (a condition compares numbers)")
        needs.append({producer[t] for _, t in wanted if t in producer})
    for spec in draft.outputs:
        if spec.name not in produced or spec.name not in producer:
            raise ConfigError(f"{where}: output {spec.name!r} is the output of no step")
        _match(f"{where}: output {spec.name!r}", spec, produced[spec.name], spec.name)
    stages = _stages(where, draft.steps, needs)
    config = ModelConfig(name=draft.name, backend=ENSEMBLE,
                         max_batch_size=draft.max_batch_size, inputs=draft.inputs,
                         outputs=draft.outputs, queue=_queue(configs))
    return EnsemblePlan(config, draft.steps, stages, frozenset(s.model for s in draft.steps))


def _step_model(where: str, step: Step, draft: EnsembleDraft,
                models: Mapping[str, ModelConfig]) -> ModelConfig:
    config = models.get(step.model)
    if config is None:
        raise ConfigError(f"{where} step {step.model!r}: model {step.model!r} is not loaded "
                          "(not in the repository, or unavailable; an ensemble is no step)")
    if step.version and step.version not in config.served_versions:
        raise ConfigError(f"{where} step {step.model!r}: version {step.version} is not "
                          f"served (versions: {', '.join(config.served_versions)})")
    if draft.max_batch_size > config.max_batch_size or (config.batched and not
                                                         draft.max_batch_size):
        raise ConfigError(f"{where} step {step.model!r}: the ensemble's max_batch_size "
                          f"{draft.max_batch_size} does not fit the model's "
                          f"{config.max_batch_size} (it must be at most the model's, and 0 "
                          "only over models of max_batch_size 0)")
    return config


def _spec(where: str, step: Step, specs: tuple[TensorSpec, ...], name: str,
          kind: str) -> TensorSpec:
    for spec in specs:
        if spec.name == name:
            return spec
    raise ConfigError(f"{where} step {step.model!r}: model {step.model!r} has no {kind} "
                      f"{name!r} (its {kind}s: {', '.join(s.name for s in specs)})")


def _match(what: str, wanted: TensorSpec, given: TensorSpec, tensor: str) -> None:
    """The tensor ``given`` fits where ``wanted`` is declared: same datatype, same rank,
    each dim equal or variable (-1) on either side."""
    if wanted.datatype != given.datatype:
        raise ConfigError(f"{what} is {wanted.datatype}, but {tensor!r} is {given.datatype}")
    fits = len(wanted.shape) == len(given.shape) and all(
        a == b or -1 in (a, b) for a, b in zip(wanted.shape, given.shape, strict=True))
    if not fits:
        raise ConfigError(f"{what} has shape {list(wanted.shape)}, but {tensor!r} has "
                          f"{list(given.shape)}")


def _stages(where: str, steps: tuple[Step, ...],
            needs: list[set[int]]) -> tuple[tuple[Step, ...], ...]:
    """The steps in stages (Kahn's order); steps left over form a cycle."""
    done: set[int] = set()
    stages = []
    while len(done) < len(steps):
        ready = [i for i in range(len(steps)) if i not in done and needs[i] <= done]
        if not ready:
            cycle = [steps[i].model for i in range(len(steps)) if i not in done]
            raise ConfigError(f"{where}: steps {', '.join(map(repr, cycle))} form a cycle "
                              "(each needs another's output)")
        stages.append(tuple(steps[i] for i in ready))
        done.update(ready)
    return tuple(stages)


def _queue(configs: list[ModelConfig]) -> QueueConfig:
    """The ensemble's queue knobs as its requests see them: priorities up to the most
    levels of its steps (each step takes the priority bounded by its own levels) and the
    longest default timeout of its steps (each step's own still bounds it)."""
    levels = max(c.queue.priority_levels for c in configs)
    return QueueConfig(priority_levels=levels, default_priority=0,
                       default_timeout_ms=max(c.queue.default_timeout_ms for c in configs))

