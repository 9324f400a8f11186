"""What the API sends Redis to admit requests (api/dispatch.py sends it and reads the answers).

A write's requests for one stream are admitted by one call of batching/lua/admit_many.lua,
which checks each against the model's rows waiting and its limit and appends it, in one
step. A request whose entry is larger than :data:`LARGE_ENTRY_BYTES` (its tensors sent
through Redis) takes two steps instead: batching/lua/admit_rows.lua reserves its rows, in
the same write as the others, and a plain ``XADD`` appends it once the reservation has
answered, so Redis never copies its bytes into Lua and back out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from batching.envelope import FIELD, Reply
from batching.lua import script

REQUEST_ADMIT = script("admit_many")
"""Admits the requests of one write that go to one stream in one call."""
ADMIT_ROWS = script("admit_rows").text
"""Reserves one large request's rows; sent whole with each EVAL (it is small)."""
LARGE_ENTRY_BYTES = 8192
"""An entry above this size is admitted by :data:`ADMIT_ROWS` and a plain ``XADD``: a
round trip more, against Redis copying the bytes twice through Lua (a 150 KB entry cost
Redis's main thread 337 µs a request through admit_many.lua)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """Where a request goes and what it may cost: its stream and the model's row budget."""

    stream: str
    rows_key: str
    rows: int
    max_rows: int
    model: str = ""
    """The model's name, for withdrawing the request; "" never withdraws it."""
    partition: int = 0
    """The model's partition ``stream`` and ``rows_key`` belong to (``queue.partitions``)."""


Pending = tuple[Admission, bytes, "asyncio.Future[Reply]"]
"""A request in the outbox: where it goes, its encoded entry, its waiter."""


def admit_command(verb: str, script_ref: str, group: list[Pending]) -> tuple[Any, ...]:
    """The admission of ``group`` (requests for one stream) as one script call."""
    first = group[0][0]
    args: list[Any] = [verb, script_ref, 2, first.rows_key, first.stream, first.max_rows]
    for admission, data, _ in group:
        args += (admission.rows, data)
    return tuple(args)


def reserve_command(admission: Admission) -> tuple[Any, ...]:
    """A large request's first step: its rows reserved, or refused as admit_many.lua would
    (the answer: rows waiting after it, or ``-(rows waiting) - 1``)."""
    return ("EVAL", ADMIT_ROWS, 1, admission.rows_key, admission.max_rows, admission.rows)


def append_command(admission: Admission, data: bytes) -> tuple[Any, ...]:
    """A large request's second step: its entry, with the fields admit_many.lua writes."""
    return ("XADD", admission.stream, "*", FIELD, data, "r", admission.rows)
