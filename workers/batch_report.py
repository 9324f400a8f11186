"""What an inference loop tells its batch listener of each executed batch (for Flower).

The loop builds one :class:`BatchReport` per batch it answered; :mod:`workers.events`
turns the reports into Celery task events. A batch failed when any of its requests was
answered with an error (the model raised, say): :func:`failure` says how.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batching.envelope import Reply
from batching.former import Entry


@dataclass(frozen=True, slots=True)
class BatchReport:
    rows: int
    reason: str
    """Why the policy dispatched it (``full``, ``deadline``, ... or ``drain``)."""
    received: float
    """Wall-clock seconds when the process read the batch's first request."""
    started: float
    """When the batch went into the model."""
    answered: float
    """When its answers were sent."""
    error: str = ""
    """Empty when every request was answered with outputs; else :func:`failure`'s text."""


BatchListener = Callable[[BatchReport], None]
"""Told of every executed batch (for Celery task events)."""


def failure(answered: Sequence[tuple[Entry, Reply]]) -> str:
    """How a batch failed: the first error, and how many requests got one unless all did
    (``""`` when none did)."""
    failed = [reply for _, reply in answered if not reply.ok]
    if not failed:
        return ""
    first = f"{failed[0].error_code}: {failed[0].error}"
    if len(failed) == len(answered):
        return first
    return f"{len(failed)} of {len(answered)} requests failed, the first with {first}"
