"""A lone request on every core, when that is faster: a CPU model whose threads leave cores
to the processes beside it may run a batch of one lone request (its API process had
nothing else in flight) with the threads of no reserve (``CONVEYOR_LONE_ALL_CORES``,
docs/data-path.md section 7)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from batching.config import ModelConfig
from workers.backends import Arrays, LoadedModel, load_model
from workers.cpu_threads import cpu_threads

log = logging.getLogger(__name__)

LONE_SESSION_MAX_BYTES = 512 << 20
"""The largest onnx model (its folder's files) that gets a second session on every core
for lone requests (:func:`load_served`): the session costs about 1.5 times the file."""
PROBE_EVERY = 32
"""Once both ways of running a lone batch are measured, every this many lone batches run
the way not chosen, so that a change (a host grown busier, a model warmed up) is seen."""
MEASURE = 3
"""Lone batches each way measures (after a warm-up) before the faster one is chosen."""
SMOOTHING = 0.2
"""Weight of a lone batch's time in its way's smoothed time per row."""
SWITCH_MARGIN = 0.9
"""Once chosen, a way is left only for one at least 10% faster: two ways about as fast
(a small model) would otherwise take turns with every lone batch's noise."""


class EveryCore:
    """A CPU model whose intra-op threads leave ``CONVEYOR_RESERVED_CORES`` to the processes
    beside it, with a second way to run a lone batch: on every core. A lone request is one
    its API process had alone in flight, so the API waits idle for it and the reserved
    cores have nothing to do (``CONVEYOR_LONE_ALL_CORES``, docs/data-path.md section 7).

    More threads pay only for a batch with enough work to share (mlp_medium: 1.2 against
    2.1 ms a row); a small model runs as fast or slower on them. So each way's time per row
    of a lone batch is measured (:data:`MEASURE` runs each, after a warm-up, taking turns)
    and lone batches run the faster way, the other one every :data:`PROBE_EVERY` lone
    batches."""

    def __init__(self, name: str, reserved: LoadedModel, every_core: LoadedModel,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.name = name
        self.reserved = reserved
        self.every_core = every_core
        self._clock = clock
        self._runs = [0, 0]
        """Lone batches run each way: on the reserved threads [0], on every core [1]."""
        self._per_row: list[float | None] = [None, None]
        """Each way's smoothed seconds per row, once it has run after its warm-up."""
        self._chosen: int | None = None

    def predict(self, inputs: Arrays) -> Arrays:
        return self.reserved.predict(inputs)

    def predict_lone(self, inputs: Arrays, rows: int) -> Arrays:
        """A lone batch of ``rows`` rows, run the way that is faster for it."""
        way = self._way()
        began = self._clock()
        outputs = (self.every_core if way else self.reserved).predict(inputs)
        self._learn(way, (self._clock() - began) / max(1, rows))
        return outputs

    def _way(self) -> int:
        if self._chosen is None:  # still measuring: the way with fewer runs, every core first
            return 0 if self._runs[0] < self._runs[1] else 1
        return 1 - self._chosen if sum(self._runs) % PROBE_EVERY == 0 else self._chosen

    def _learn(self, way: int, per_row: float) -> None:
        self._runs[way] += 1
        measured = self._runs[way] - 1  # the first run is a warm-up: allocations, caches
        if measured < 1:
            return
        seen = self._per_row[way]
        weight = max(SMOOTHING, 1 / measured)  # the mean of the first few, then smoothed
        self._per_row[way] = per_row if seen is None else seen + weight * (per_row - seen)
        reserved, every = self._per_row
        if reserved is None or every is None or min(self._runs) < 1 + MEASURE:
            return
        if self._chosen is None:
            chosen = 1 if every < reserved else 0
        else:  # the other way, only if it is faster by the margin
            times, other = (reserved, every), 1 - self._chosen
            switch = times[other] < times[self._chosen] * SWITCH_MARGIN
            chosen = other if switch else self._chosen
        if chosen != self._chosen:
            # The first choice is news to an operator; later turns back and forth are not.
            level = logging.INFO if self._chosen is None else logging.DEBUG
            self._chosen = chosen
            log.log(level, "%s: lone requests run %s (%.3f ms a row on every core, %.3f ms on "
                    "the reserved threads)", self.name, "on every core" if chosen else
                    "on the reserved threads", every * 1e3, reserved * 1e3)


class _TorchThreads:
    """A loaded torch model run with ``threads`` intra-op threads for one call, then given
    back the ``usual`` ones: torch's pool is resized in place, the weights are shared."""

    def __init__(self, model: LoadedModel, threads: int, usual: int) -> None:
        self._model = model
        self._threads = threads
        self._usual = usual

    def predict(self, inputs: Arrays) -> Arrays:
        import torch

        torch.set_num_threads(self._threads)
        try:
            return self._model.predict(inputs)
        finally:
            torch.set_num_threads(self._usual)


def load_served(config: ModelConfig, folder: Path, device: str,
                lone: ModelConfig | None) -> LoadedModel:
    """:func:`load_model`, and with ``lone`` (the same model with more intra-op threads, from
    :func:`workers.cpu_threads.lone_threads`) an :class:`EveryCore` that runs lone batches with those: torch
    resizes its pool around the call; onnxruntime, whose pool is fixed per session, gets a
    second session (with its own copy of the weights as onnxruntime lays them out: about
    1.5 times the file), unless the model's folder holds more than
    :data:`LONE_SESSION_MAX_BYTES`."""
    model = load_model(config, folder, device)
    if lone is None:
        return model
    if config.backend == "onnx":
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        if size > LONE_SESSION_MAX_BYTES:
            log.info("%s: no second session for lone requests: the model's folder holds "
                     "%d MiB, over %d MiB", config.name, size >> 20, LONE_SESSION_MAX_BYTES >> 20)
            return model
        return EveryCore(config.name, model, load_model(lone, folder, device))
    threads = _TorchThreads(model, cpu_threads(lone).intra_op, cpu_threads(config).intra_op)
    return EveryCore(config.name, model, threads)
