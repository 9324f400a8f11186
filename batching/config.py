"""A model's configuration: the ``config.yaml`` keys of DESIGN section 8, typed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batching.datatypes import DATATYPES

BACKENDS = {"torchscript": "model.pt", "torch_export": "model.pt2", "onnx": "model.onnx",
            "python": "model.py"}


class ConfigError(ValueError):
    """A ``config.yaml`` that cannot be served; the message names the key."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output. ``shape`` includes the batch dim first; -1 is variable."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    pad_axis: int | None = None
    """Inputs: a variable axis padded to the longest in a batch, so ragged requests share
    one. Outputs: the axis that follows the padded input axis, cut back per request."""
    pad_value: float = 0

    def describe(self) -> str:
        return f"{self.name} {self.datatype} {list(self.shape)}"


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    latency_target_ms: float = 50.0
    adaptive: bool = True


@dataclass(frozen=True, slots=True)
class QueueConfig:
    priority_levels: int = 3
    default_priority: int = 2
    max_queue_rows: int = 10000
    default_timeout_ms: int = 30000


@dataclass(frozen=True, slots=True)
class InstanceGroup:
    device: str = "cpu"
    count: int = 1


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    backend: str
    max_batch_size: int = 64
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    execution_timeout_s: float = 60.0
    max_batch_cost: float | None = None
    """Bound on the summed ``parameters.cost`` of the requests in one batch."""
    max_deliveries: int = 3
    """Deliveries of one entry (each a process that took it and died) before dead-lettering."""
    instances: tuple[InstanceGroup, ...] = (InstanceGroup(),)
    parameters: dict[str, Any] = field(default_factory=dict)

    def input(self, name: str) -> TensorSpec | None:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        return None

    @classmethod
    def from_dict(cls, name: str, raw: dict[str, Any], backend: str | None = None) -> ModelConfig:
        """Parse a ``config.yaml`` mapping; ``backend`` is the one inferred from the artifact."""
        known = {"backend", "max_batch_size", "inputs", "outputs", "batching", "queue",
                 "execution_timeout_s", "max_deliveries", "max_batch_cost", "instances",
                 "parameters", "platform"}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"{name}: unknown keys {sorted(unknown)}")
        chosen = raw.get("backend") or backend
        if chosen not in BACKENDS:
            raise ConfigError(f"{name}: backend must be one of {sorted(BACKENDS)}, got {chosen!r}")
        max_batch = _int(name, "max_batch_size", raw.get("max_batch_size", 64), minimum=1)
        queue = QueueConfig(**_section(name, "queue", raw.get("queue"), QueueConfig))
        if not 1 <= queue.default_priority <= queue.priority_levels:
            raise ConfigError(f"{name}: queue.default_priority must be within 1..priority_levels")
        return cls(
            name=name,
            backend=chosen,
            max_batch_size=max_batch,
            inputs=_tensors(name, "inputs", raw.get("inputs") or []),
            outputs=_tensors(name, "outputs", raw.get("outputs") or []),
            batching=BatchingConfig(**_section(name, "batching", raw.get("batching"), BatchingConfig)),
            queue=queue,
            execution_timeout_s=float(raw.get("execution_timeout_s", 60.0)),
            max_deliveries=_int(name, "max_deliveries", raw.get("max_deliveries", 3), minimum=1),
            max_batch_cost=_cost(name, raw.get("max_batch_cost")),
            instances=tuple(
                InstanceGroup(**_section(name, f"instances[{i}]", item, InstanceGroup))
                for i, item in enumerate(raw.get("instances") or [{}])
            ),
            parameters=dict(raw.get("parameters") or {}),
        )


def _int(model: str, key: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{model}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _cost(model: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{model}: max_batch_cost must be a positive number, got {value!r}")
    return float(value)


def _section(model: str, key: str, raw: Any, kind: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{model}: {key} must be a mapping")
    allowed = set(kind.__dataclass_fields__)
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{model}: unknown keys in {key}: {sorted(unknown)}")
    out = dict(raw)
    if "preferred_batch_sizes" in out:
        out["preferred_batch_sizes"] = tuple(int(v) for v in out["preferred_batch_sizes"])
    return out


def _tensors(model: str, key: str, raw: list[Any]) -> tuple[TensorSpec, ...]:
    specs = []
    for i, item in enumerate(raw):
        where = f"{model}: {key}[{i}]"
        if not isinstance(item, dict) or not {"name", "datatype", "shape"} <= set(item):
            raise ConfigError(f"{where} needs name, datatype and shape")
        if item["datatype"] not in DATATYPES:
            raise ConfigError(f"{where}: unknown datatype {item['datatype']!r}")
        shape = tuple(int(d) for d in item["shape"])
        if not shape or any(d < -1 or d == 0 for d in shape):
            raise ConfigError(f"{where}: shape needs the batch dim first and dims > 0 or -1")
        pad = item.get("pad")
        axis = None
        if pad is not None:
            axis = pad.get("axis") if isinstance(pad, dict) else None
            if not isinstance(axis, int) or not 1 <= axis < len(shape) or shape[axis] != -1:
                raise ConfigError(f"{where}: pad.axis must name a variable (-1) axis after the "
                                  "batch dim")
        specs.append(TensorSpec(str(item["name"]), str(item["datatype"]), shape, axis,
                                float(pad.get("value", 0)) if pad else 0))
    return tuple(specs)
