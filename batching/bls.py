"""Calls to other served models from a Python model's ``predict`` (Triton's BLS)::

    from batching.bls import infer

    class Model:
        def predict(self, inputs):
            return {"y": infer("classify", {"x": inputs["x"]})["logits"]}

Each call is an ordinary request of the called model: admitted into its stream against
its row limit, batched with its other requests, answered onto the inference process's
own reply list (workers/model_calls.py). It carries the calling batch's deadline (the
earliest of its requests', or sooner with ``timeout_s``) and priority (the most urgent of
its requests'), or those of the requests holding the ``rows`` it serves, so a call never
outlives the requests that made it. An error of the called model
is raised in ``predict`` as :class:`~batching.errors.ModelCallFailed` (also of the
error's own type); uncaught, it fails the batch as any model error does.

The inference process sets :func:`batch` around ``predict`` (a context variable, so the
threads of :func:`async_infer` and ``asyncio`` tasks see it too).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import numpy.typing as npt

from batching.config import ModelConfig
from batching.envelope import WHOLE, Request, Tensor
from batching.errors import ModelFailure
from batching.signature import check_inputs

Arrays = dict[str, npt.NDArray[Any]]


class Caller(Protocol):
    """What runs a call: admits it into the called model's stream and awaits its reply."""

    def call(self, model: str, inputs: Mapping[str, npt.NDArray[Any]], deadline_ms: int,
             priority: int) -> Arrays: ...


Span = tuple[int, int, int]
"""One request of a batch: its rows, deadline (ms since the epoch), priority (1 = highest)."""


@dataclass(frozen=True, slots=True)
class BatchContext:
    """The batch ``predict`` runs now: its model, its requests in row order, and what
    makes its calls."""

    model: str
    spans: tuple[Span, ...]
    caller: Caller

    @property
    def deadline_ms(self) -> int:
        """The batch's deadline: the earliest of its requests'."""
        return min(span[1] for span in self.spans)

    @property
    def priority(self) -> int:
        """The batch's priority: the most urgent of its requests' (1 is the highest)."""
        return min(span[2] for span in self.spans)

    def of_rows(self, rows: slice | None) -> tuple[int, int]:
        """The deadline and priority of the batch's ``rows`` (None: all): the earliest
        and the most urgent of the requests that hold them."""
        if rows is None:
            return self.deadline_ms, self.priority
        start, stop, _ = rows.indices(sum(span[0] for span in self.spans))
        held: list[Span] = []
        first = 0
        for span in self.spans:
            if first < stop and first + span[0] > start:
                held.append(span)
            first += span[0]
        if not held:
            return self.deadline_ms, self.priority
        return min(span[1] for span in held), min(span[2] for span in held)


_current: ContextVar[BatchContext | None] = ContextVar("conveyor_batch", default=None)


@contextmanager
def batch(context: BatchContext) -> Iterator[BatchContext]:
    """``context`` is the batch of the calls made inside the block."""
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def current() -> BatchContext:
    """The batch ``predict`` runs now: its deadline and priority, which a model may read."""
    context = _current.get()
    if context is None:
        raise RuntimeError("batching.bls works only inside a served model's predict")
    return context


def call_deadline_ms(batch_deadline: int, now_ms: float, timeout_s: float | None) -> int:
    """A call's deadline: the batch's, or ``timeout_s`` from now when that is sooner."""
    if timeout_s is None:
        return batch_deadline
    return min(batch_deadline, int(now_ms + timeout_s * 1000.0))


def call_request(config: ModelConfig, inputs: Mapping[str, npt.NDArray[Any]], request_id: str,
                 reply: str, deadline_ms: int, priority: int, now_ms: float) -> Request:
    """The request envelope of a call to ``config``'s model, checked against its
    signature; ``priority`` held within its levels."""
    tensors = [Tensor.from_array(name, array) for name, array in inputs.items()]
    check_inputs(config, [(t.name, t.datatype, t.shape) for t in tensors])
    params: dict[str, Any] = {} if config.batched else {WHOLE: 1}
    return Request(request_id, reply, deadline_ms, now_ms,
                   min(priority, config.queue.priority_levels), tensors, params=params)


def infer(model: str, inputs: Mapping[str, npt.NDArray[Any]], *,
          timeout_s: float | None = None, rows: slice | None = None) -> Arrays:
    """Run ``inputs`` through served model ``model``; its outputs by name. ``rows``: the
    batch's rows the call serves, whose requests' deadline and priority it carries (None:
    the whole batch's).

    Raises :class:`~batching.errors.ModelCallFailed` when the called model answers an
    error, or the call cannot be made in time; :class:`~batching.errors.ModelFailure` for
    a call of the calling model itself (its batch would wait on itself).
    """
    context = current()
    if model == context.model:
        raise ModelFailure(f"model {model!r} called itself from predict: refused (the batch "
                           "would wait for itself)")
    deadline_ms, priority = context.of_rows(rows)
    deadline = call_deadline_ms(deadline_ms, time.time() * 1000.0, timeout_s)
    return context.caller.call(model, inputs, deadline, priority)


async def async_infer(model: str, inputs: Mapping[str, npt.NDArray[Any]], *,
                      timeout_s: float | None = None, rows: slice | None = None) -> Arrays:
    """:func:`infer` awaited: several run at once under ``asyncio.gather``."""
    return await asyncio.to_thread(infer, model, inputs, timeout_s=timeout_s, rows=rows)
