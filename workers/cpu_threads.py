"""How many threads a CPU model's framework gets: ``cpu_threads`` from ``config.yaml``, or
when its intra-op threads are unset, the cores of the process less those reserved for the
processes beside the model (``CONVEYOR_RESERVED_CORES``), divided among its CPU instances;
and the threads a lone request gets instead (``CONVEYOR_LONE_ALL_CORES``)."""

from __future__ import annotations

import dataclasses
import os

from batching.config import ModelConfig
from batching.config_schema import THREADED_BACKENDS


@dataclasses.dataclass(frozen=True, slots=True)
class Threads:
    """The thread pools one inference process gives its framework."""

    intra_op: int
    inter_op: int
    spin: bool


def cpu_threads(config: ModelConfig, cores: int | None = None, reserved: int = 0) -> Threads:
    """``config.cpu_threads``, its intra-op threads, when unset, the ``cores`` available to
    this process (its CPU affinity) less the ``reserved`` ones (``CONVEYOR_RESERVED_CORES``)
    divided among the model's CPU instances, which this worker starts side by side, and at
    least 1: one instance alone gets every core not reserved."""
    configured = config.cpu_threads
    intra_op = configured.intra_op
    if intra_op is None:
        available = len(os.sched_getaffinity(0)) if cores is None else cores
        instances = sum(group.count for group in config.instances if group.device == "cpu")
        intra_op = max(1, (available - reserved) // max(1, instances))
    return Threads(intra_op, configured.inter_op, configured.spin)


def with_cpu_threads(config: ModelConfig, reserved: int) -> ModelConfig:
    """``config`` with unset intra-op threads derived now, ``reserved`` cores left to the
    processes beside the model (see :func:`cpu_threads`); a backend without thread pools
    (python) is left as it is."""
    if config.backend not in THREADED_BACKENDS or config.cpu_threads.intra_op is not None:
        return config
    return _with_intra_op(config, cpu_threads(config, reserved=reserved).intra_op)


def lone_threads(config: ModelConfig, reserved: int, device: str,
                 cores: int | None = None) -> ModelConfig | None:
    """``config`` with the intra-op threads a lone batch gets (:class:`EveryCore`): those
    derived with no core reserved, when that is more than ``reserved`` leaves; None when
    it is not (threads set in ``config.yaml``, no reserve, a single core, a GPU instance or
    a backend without thread pools)."""
    if (device != "cpu" or config.backend not in THREADED_BACKENDS
            or config.cpu_threads.intra_op is not None):
        return None
    every = cpu_threads(config, cores, 0).intra_op
    if every <= cpu_threads(config, cores, reserved).intra_op:
        return None
    return _with_intra_op(config, every)


def _with_intra_op(config: ModelConfig, intra_op: int) -> ModelConfig:
    return dataclasses.replace(config,
                               cpu_threads=dataclasses.replace(config.cpu_threads, intra_op=intra_op))
