"""A model's configuration: the ``config.yaml`` keys of docs/configuration.md, typed.

Validation of the keys lives in :mod:`batching.config_schema`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batching.config_schema import (
    BACKENDS,
    BatchingSchema,
    ConfigError,
    ConfigSchema,
    CpuThreadsSchema,
    InstanceSchema,
    QueueSchema,
    TensorSchema,
    intra_op_threads,
    parse_config,
)

__all__ = ["BACKENDS", "BatchingConfig", "ConfigError", "CpuThreads", "InstanceGroup",
           "ModelConfig", "QueueConfig", "TensorSpec", "VersionPolicy"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output. ``shape`` includes the batch dim first (none when the model's
    ``max_batch_size`` is 0); -1 is variable."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    pad_axis: int | None = None
    """Inputs: a variable axis padded to the longest in a batch, so ragged requests share
    one. Outputs: the axis that follows the padded input axis, cut back per request."""
    pad_value: float = 0
    reshape: tuple[int, ...] | None = None
    """The shape (less the batch dim) the model itself takes or gives (Triton's
    ``reshape``), when not ``shape``'s."""

    def describe(self) -> str:
        return f"{self.name} {self.datatype} {list(self.shape)}"


ADAPTIVE_BOUND_US = 20000
"""The adaptive policy's longest wait when ``max_queue_delay_us`` is not set. It waits only
when a fuller batch is needed to keep up (never at low load); on mlp_medium at 64
concurrent clients such waits took the mean batch from 23 to 40-50 rows and throughput up
by 40% (docs/batching.md)."""


def queue_delay_us(batching: BatchingSchema) -> int:
    """``max_queue_delay_us`` as set, or by default ``ADAPTIVE_BOUND_US`` for the adaptive
    policy and 0 (take what is waiting, as Triton does) for a fixed window."""
    if batching.max_queue_delay_us is not None:
        return batching.max_queue_delay_us
    return ADAPTIVE_BOUND_US if batching.adaptive else 0


def overload(batching: BatchingSchema) -> str:
    """``overload`` as set, or by default ``lifo`` for a model whose ``latency_target_ms``
    is set and ``fifo`` for one left at the default target: a model that states a target
    is served against it past capacity (newest first, what cannot make it refused at
    once), and one that does not is served as Triton serves, every request in the order
    of its deadline (docs/batching.md)."""
    if batching.overload is not None:
        return batching.overload
    return "lifo" if "latency_target_ms" in batching.model_fields_set else "fifo"


UNSET = -1


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    max_queue_delay_us: int = UNSET
    """Left unset, ``ADAPTIVE_BOUND_US`` for the adaptive policy and 0 for a fixed window,
    as in :func:`queue_delay_us`."""
    preferred_batch_sizes: tuple[int, ...] = ()
    latency_target_ms: float = 50.0
    adaptive: bool = True
    overload: str = "fifo"
    """Past capacity, the adaptive policy's order (docs/batching.md): ``lifo``, newest
    first and what cannot make the latency target answered at once; ``fifo``, the order
    of deadlines and only what cannot make its own deadline answered at once. From a
    configuration, ``lifo`` by default where ``latency_target_ms`` is set
    (:func:`overload`)."""

    def __post_init__(self) -> None:
        if self.max_queue_delay_us == UNSET:
            object.__setattr__(self, "max_queue_delay_us",
                               ADAPTIVE_BOUND_US if self.adaptive else 0)


@dataclass(frozen=True, slots=True)
class QueueConfig:
    priority_levels: int = 3
    default_priority: int = 2
    max_queue_rows: int = 10000
    default_timeout_ms: int = 30000
    max_priority_wait_ms: int | None = None
    """Priority aging (docs/batching.md): a request of a lower level queued this long is
    served ahead of every level; None keeps priority strict."""
    partitions: int = 1
    """Sets of streams and counters, each its own hash slot, the model's requests are
    spread over (docs/data-path.md, "Partitions")."""

    @property
    def partition_rows(self) -> int:
        """Each partition's share of ``max_queue_rows``, rounded up: the rows waiting in
        all partitions together stay below ``max_queue_rows + partitions``."""
        return -(-self.max_queue_rows // self.partitions)


@dataclass(frozen=True, slots=True)
class InstanceGroup:
    device: str = "cpu"
    count: int = 1


@dataclass(frozen=True, slots=True)
class CpuThreads:
    """``cpu_threads``: the thread pools of each inference process's framework."""

    intra_op: int | None = None
    """None: the cores available to the process, shared among the model's CPU instances."""
    inter_op: int = 1
    spin: bool = False
    """onnxruntime's idle threads spin instead of sleeping (off: the cores are shared)."""


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    """Which version folders a model serves: ``kind`` is "latest" (the newest ``latest``),
    "all", or "specific" (``specific``)."""

    kind: str = "latest"
    latest: int = 1
    specific: tuple[int, ...] = ()

    def choose(self, found: list[int]) -> list[int]:
        """The versions served out of the version folders ``found``, ascending."""
        ordered = sorted(found)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.specific]
        return ordered[-self.latest:]


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
    cpu_threads: CpuThreads = field(default_factory=CpuThreads)
    parameters: dict[str, Any] = field(default_factory=dict)
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    versions: tuple[str, ...] = ()
    """The version folders served, ascending; () for a model whose artifact lies in its
    folder itself, served as version "1"."""
    model_filename: str | None = None

    @property
    def batched(self) -> bool:
        """False for ``max_batch_size: 0``: no batch dim, each request runs alone."""
        return self.max_batch_size > 0

    @property
    def batch_rows(self) -> int:
        """The rows one batch may hold (a model without a batch dim: one request)."""
        return max(1, self.max_batch_size)

    @property
    def served_versions(self) -> tuple[str, ...]:
        return self.versions or ("1",)

    @property
    def artifact(self) -> str:
        """The artifact's file name in the model (or version) folder."""
        return self.model_filename or BACKENDS[self.backend]

    def input(self, name: str) -> TensorSpec | None:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        return None

    @classmethod
    def from_dict(cls, name: str, raw: dict[str, Any], backend: str | None = None) -> ModelConfig:
        """Parse a ``config.yaml`` mapping; ``backend`` is the one inferred from the artifact.

        Raises :class:`ConfigError` naming ``name``, the key path and the reason."""
        schema, chosen = parse_config(name, raw, backend)
        batching = schema.batching or BatchingSchema()
        queue = schema.queue or QueueSchema()
        threads = schema.cpu_threads or CpuThreadsSchema()
        return cls(
            name=name,
            backend=chosen,
            max_batch_size=schema.max_batch_size,
            inputs=tuple(_tensor(t) for t in schema.inputs or ()),
            outputs=tuple(_tensor(t) for t in schema.outputs or ()),
            batching=BatchingConfig(queue_delay_us(batching),
                                    tuple(batching.preferred_batch_sizes),
                                    batching.latency_target_ms, batching.adaptive,
                                    overload(batching)),
            queue=QueueConfig(queue.priority_levels, queue.default_priority,
                              queue.max_queue_rows, queue.default_timeout_ms,
                              queue.max_priority_wait_ms, queue.partitions),
            execution_timeout_s=schema.execution_timeout_s,
            max_batch_cost=schema.max_batch_cost,
            max_deliveries=schema.max_deliveries,
            instances=tuple(InstanceGroup(g.device, g.count)
                            for g in schema.instances or [InstanceSchema()]),
            cpu_threads=CpuThreads(intra_op_threads(schema, chosen), threads.inter_op,
                                   threads.spin),
            parameters=dict(schema.parameters or {}),
            version_policy=_policy(schema),
            model_filename=schema.model_filename,
        )


def _policy(schema: ConfigSchema) -> VersionPolicy:
    policy = schema.version_policy
    if policy is None:
        return VersionPolicy()
    if policy.latest is not None:
        return VersionPolicy("latest", policy.latest)
    if policy.specific is not None:
        return VersionPolicy("specific", specific=tuple(policy.specific))
    return VersionPolicy("all")


def _tensor(spec: TensorSchema) -> TensorSpec:
    pad = spec.pad
    return TensorSpec(spec.name, spec.datatype, tuple(spec.shape),
                      pad.axis if pad else None, pad.value if pad else 0,
                      None if spec.reshape is None else tuple(spec.reshape))
