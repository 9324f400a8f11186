"""Running one batch through the model: stack the entries' inputs, predict, split the
outputs into one reply per entry, and on out of memory bisect the batch (then a single
request's rows) until what is left fits or one row fails alone. ``predict`` runs in its
batch's context (batching/bls.py): the deadline and priority its calls to other models carry.

The runner touches nothing the loop's thread uses (it may run on the model thread,
workers/model_thread.py): what a batch showed of device memory goes back in its
:class:`Outcome`, for the loop to learn from (workers/inference.py).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from batching.bls import BatchContext, Caller
from batching.bls import batch as calls_of
from batching.datatypes import from_numpy, to_raw
from batching.envelope import VERSION, Reply, Tensor
from batching.errors import ConveyorError, ModelFailure, Unavailable
from batching.former import Batch, Entry, Layout
from workers.backends import (
    LoadedModel,
    error_summary,
    is_fatal_device_error,
    is_out_of_memory,
)
from workers.every_core import EveryCore
from workers.model_calls import DeferredCalls

log = logging.getLogger("conveyor.inference")

Arrays = dict[str, npt.NDArray[Any]]


class DeviceLost(Exception):
    """The device context is unusable; only a new process can recover."""


@dataclass(slots=True)
class Outcome:
    """One batch run by the model, for the loop's thread to answer and count."""

    batch: Batch
    started: float
    answered: list[tuple[Entry, Reply]] = field(default_factory=list)
    finished: float = 0.0
    phase_ns: list[int] = field(default_factory=lambda: [0, 0, 0])
    """Nanoseconds spent stacking inputs, in the model, and splitting and packing outputs
    (Triton's compute_input, compute_infer, compute_output)."""
    fits: list[tuple[bool, int, int]] = field(default_factory=list)
    """Each predict's rows, its padded length (1 without a padded axis) and whether they
    fitted in device memory, in order: the memory cap learns from them on the loop's
    thread."""
    prep_s: float | None = None
    """Run on the loop's thread: the CPU seconds that thread spent since the previous batch
    was answered (reading, decoding, forming this one). None: run on the model thread."""


class BatchRunner:
    """One model instance's way of running entries: its loaded model (and versions), the
    batch layout, and the output datatypes (learned from the first outputs where the
    configuration names none)."""

    calls: Caller = DeferredCalls()
    """What makes the calls of a Python model's ``predict`` (batching/bls.py)."""

    def __init__(self, name: str, layout: Layout, model: LoadedModel,
                 versions: dict[str, LoadedModel], out_types: dict[str, str]) -> None:
        self.name = name
        self.layout = layout
        self.model = model
        self.versions = versions
        self._out_types = out_types

    def stack(self, batch: Batch) -> Arrays | None:
        """``batch``'s inputs stacked ahead of its run, into the buffer its model offers
        (``staging``: pinned host memory on a GPU); None where the model offers none, or
        the batch cannot be stacked (its run then finds out why)."""
        try:
            staging = getattr(self._model_for(batch.entries[0]), "staging", None)
            return None if staging is None else batch.stacked_inputs(staging)
        except (ConveyorError, ValueError, TypeError):  # the run stacks again and answers it
            return None

    def run_entries(self, entries: list[Entry], done: Outcome,
                    stacked_inputs: Arrays | None = None) -> list[tuple[Entry, Reply]]:
        """Run ``entries`` as one batch (their inputs already stacked: ``stacked_inputs``)."""
        rows = sum(e.rows for e in entries)
        batch = Batch(entries, "", self.layout)
        width = batch.width
        phases = done.phase_ns
        begun = time.perf_counter_ns()
        try:
            model = self._model_for(entries[0])
            inputs = (stacked_inputs if stacked_inputs is not None
                      else batch.stacked_inputs(getattr(model, "staging", None)))
            stacked = time.perf_counter_ns()
            phases[0] += stacked - begun
            with calls_of(self._context(entries)):
                outputs = self.predict(inputs, rows, model, batch.lone)
            phases[1] += time.perf_counter_ns() - stacked
        except ConveyorError as exc:
            return [(e, Reply(e.request.id, error_code=exc.code, error=exc.message))
                    for e in entries]
        except _OutOfMemory:
            done.fits.append((False, rows, width))
            if len(entries) == 1:
                return [(entries[0], self._oom_alone(entries[0], done))]
            half = len(entries) // 2
            return (self.run_entries(entries[:half], done)
                    + self.run_entries(entries[half:], done))
        done.fits.append((True, rows, width))
        exec_ms = (time.time() - done.started) * 1000.0
        splitting = time.perf_counter_ns()
        answered = [(entry, Reply(
            entry.request.id, tensors, batch_rows=rows, exec_ms=exec_ms,
            queue_ms=max(0.0, done.started * 1000.0 - entry.request.enq_ms)))
            for entry, tensors in zip(entries, self._split(batch, outputs), strict=True)]
        phases[2] += time.perf_counter_ns() - splitting
        return answered

    def _split(self, batch: Batch, outputs: Arrays) -> list[list[Tensor]]:
        """Per entry, its tensors of the outputs it asked for. Where no output is cut back
        to an entry's own length, each output is made bytes once for the whole batch and
        each entry's tensor is a slice of them: not an array, a copy and a conversion
        per entry and output."""
        entries = batch.entries
        rows = batch.rows
        if (len(entries) == 1 or self.layout.unpad
                or any(a.dtype.kind in "OSU" or not a.ndim or a.shape[0] != rows
                       for a in outputs.values())):
            return [[Tensor.from_array(name, arr, self._out_types.get(name))
                     for name, arr in own.items()
                     if not entry.request.outputs or name in entry.request.outputs]
                    for entry, own in zip(entries, batch.split(outputs), strict=True)]
        tensors: list[list[Tensor]] = [[] for _ in entries]
        for name, arr in outputs.items():
            datatype = self._out_types.get(name) or from_numpy(arr.dtype)
            raw = memoryview(to_raw(arr))
            row, inner, at = len(raw) // rows, arr.shape[1:], 0
            for entry, own in zip(entries, tensors, strict=True):
                n = entry.rows
                if not entry.request.outputs or name in entry.request.outputs:
                    own.append(Tensor(name, datatype, (n, *inner), raw[at * row:(at + n) * row]))
                at += n
        return tensors

    def _oom_alone(self, entry: Entry, done: Outcome) -> Reply:
        """One request out of memory: bisect its rows; a single row that fails, fails alone."""
        try:
            alone = Batch([entry], "", self.layout)
            with calls_of(self._context([entry])):
                outputs = self._predict_halves(alone.stacked_inputs(), entry.rows, alone.width,
                                               done, self._model_for(entry))
        except _OutOfMemory:
            error = ModelFailure(f"model {self.name!r} ran out of device memory on a "
                                 "single row of this request")
            return Reply(entry.request.id, error_code=error.code, error=error.message)
        except ConveyorError as exc:
            return Reply(entry.request.id, error_code=exc.code, error=exc.message)
        wanted = entry.request.outputs
        return Reply(entry.request.id, [Tensor.from_array(n, a, self._out_types.get(n))
                                        for n, a in outputs.items() if not wanted or n in wanted],
                     batch_rows=entry.rows)

    def _predict_halves(self, inputs: Arrays, rows: int, width: int, done: Outcome,
                        model: LoadedModel) -> Arrays:
        try:
            return self.predict(inputs, rows, model)
        except _OutOfMemory:
            done.fits.append((False, rows, width))
            if rows <= 1:
                raise
            half = rows // 2
            first = self._predict_halves({k: v[:half] for k, v in inputs.items()}, half, width,
                                         done, model)
            second = self._predict_halves({k: v[half:] for k, v in inputs.items()},
                                          rows - half, width, done, model)
            return {k: np.concatenate([first[k], second[k]]) for k in first}

    def _context(self, entries: list[Entry]) -> BatchContext:
        """The batch of ``entries``, whose deadlines and priorities ``predict``'s calls carry."""
        return BatchContext(self.name, tuple((e.rows, e.request.deadline_ms, e.request.prio)
                                             for e in entries), self.calls)

    def _model_for(self, entry: Entry) -> LoadedModel:
        """The loaded version the entry asked for (a batch holds one version only)."""
        version = entry.request.params.get(VERSION)
        if not version:
            return self.model
        model = self.versions.get(version)
        if model is None:  # admitted under a configuration this process does not run
            raise Unavailable(f"model {self.name!r} version {version} is not loaded "
                              "by this process (the model is being reloaded)")
        return model

    def predict(self, inputs: Arrays, rows: int, model: LoadedModel,
                lone: bool = False) -> Arrays:
        """``lone``: a :attr:`Batch.lone` batch, which a model with cores reserved runs on
        every core (:class:`EveryCore`)."""
        try:
            if lone and isinstance(model, EveryCore):
                outputs = model.predict_lone(inputs, rows)
            else:
                outputs = model.predict(inputs)
        except ConveyorError:
            raise
        except Exception as exc:  # the model's own failure: answered, never fatal here
            if is_out_of_memory(exc):
                _free_device_cache()
                raise _OutOfMemory() from exc
            if is_fatal_device_error(exc):
                raise DeviceLost(str(exc)) from exc
            log.exception("model %s failed on a batch of %d rows", self.name, rows)
            raise ModelFailure(f"model {self.name!r} failed: "
                               f"{error_summary(exc)}") from exc
        for name, arr in outputs.items():
            if name not in self._out_types:
                self._out_types[name] = from_numpy(arr.dtype)
        return outputs


class _OutOfMemory(Exception):
    """Raised inside the loop once the device's cache is freed; the row cap learns of it
    on the loop's thread (:attr:`_Outcome.fits`)."""


def _free_device_cache() -> None:
    """After an out-of-memory error, give the allocator's cached blocks back to the device."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
