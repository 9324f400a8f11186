"""A lone request on every core: a CPU model whose threads leave cores to the processes
beside it runs a batch of one lone request (its API process had nothing else in flight)
with the threads of no reserve (``CONVEYOR_LONE_ALL_CORES``, docs/data-path.md section 7)."""

from __future__ import annotations

import logging
from pathlib import Path

from batching.config import ModelConfig
from workers.backends import Arrays, LoadedModel, load_model
from workers.cpu_threads import cpu_threads

log = logging.getLogger(__name__)

LONE_SESSION_MAX_BYTES = 512 << 20
"""The largest onnx model (its folder's files) that gets a second session on every core
for lone requests (:func:`load_served`): the session costs about 1.5 times the file."""


class EveryCore:
    """A CPU model whose intra-op threads leave ``CONVEYOR_RESERVED_CORES`` to the processes
    beside it, with a way to run a lone batch on every core: a lone request is one its API
    process had alone in flight, so the API waits idle for it and the reserved cores have
    nothing to do (``CONVEYOR_LONE_ALL_CORES``, docs/data-path.md section 7)."""

    def __init__(self, reserved: LoadedModel, every_core: LoadedModel) -> None:
        self.reserved = reserved
        self.every_core = every_core

    def predict(self, inputs: Arrays) -> Arrays:
        return self.reserved.predict(inputs)

    def predict_lone(self, inputs: Arrays) -> Arrays:
        return self.every_core.predict(inputs)


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
    :func:`lone_threads`) an :class:`EveryCore` that runs lone batches with those: torch
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
        return EveryCore(model, load_model(lone, folder, device))
    return EveryCore(model, _TorchThreads(model, cpu_threads(lone).intra_op,
                                          cpu_threads(config).intra_op))
