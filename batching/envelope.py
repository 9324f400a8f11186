"""The request and reply envelopes that travel through Redis, as msgpack.

No code-executing serializer ever touches the wire.

A request entry in a model stream has two fields: ``d``, the packed :class:`Request`, and
``r``, its rows (so that an entry that cannot be decoded still releases its rows).
A reply is one packed :class:`Reply` pushed onto the API process's reply list.
Tensors travel as raw little-endian bytes with their datatype and shape, or, for a large
input whose API process shares memory with the inference processes, as a reference to
those bytes in the API process's arena (batching/tensor_arena.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from batching.datatypes import from_numpy, from_raw, to_raw

FIELD = b"d"
"""The field of a request stream entry that holds the packed request."""
ROWS_FIELD = b"r"
"""The field holding the request's rows, readable even when the request is not."""
WHOLE = "whole"
"""``params`` key of a request to a model without a batch dim: it counts as one row,
whatever its shapes, and runs alone."""
VERSION = "version"
"""``params`` key naming the model version a request asked for (a model with version
folders; absent: the newest served)."""
PATH = "path_us"
"""``params`` key: how long the API process that sent the request has lately spent on its
model's requests outside the inference process (the admission before, the reply after), in
µs, when it knows (api/outside_path.py): the time the adaptive policy keeps for that path
when it sheds."""


@dataclass(slots=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes | memoryview
    ref: list[Any] | None = None
    """Where the bytes are instead of ``raw`` (empty then): ``[arena, offset, length,
    sequence]`` in a shared-memory arena (batching/tensor_arena.py)."""

    @classmethod
    def from_array(cls, name: str, array: npt.NDArray[Any], datatype: str | None = None) -> Tensor:
        return cls(name, datatype or from_numpy(array.dtype), tuple(array.shape), to_raw(array))

    def array(self) -> npt.NDArray[Any]:
        return from_raw(self.raw, self.datatype, self.shape)

    def pack(self) -> list[Any]:
        if self.ref is not None:
            return [self.name, self.datatype, list(self.shape), b"", self.ref]
        return [self.name, self.datatype, list(self.shape), self.raw]

    @classmethod
    def unpack(cls, item: list[Any]) -> Tensor:
        return cls(item[0], item[1], tuple(item[2]), item[3], item[4] if len(item) > 4 else None)


@dataclass(slots=True)
class Request:
    id: str
    reply: str
    deadline_ms: int
    enq_ms: float
    """When the API admitted it: ms since the epoch, to the µs (the reply's ``queue_ms``
    counts from it; whole ms would add half a ms to every queue time)."""
    prio: int
    inputs: list[Tensor]
    outputs: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        if self.params.get(WHOLE):
            return 1
        return self.inputs[0].shape[0] if self.inputs and self.inputs[0].shape else 1

    def encode(self) -> bytes:
        packed: bytes = msgpack.packb(
            [self.id, self.reply, self.deadline_ms, self.enq_ms, self.prio,
             [t.pack() for t in self.inputs], self.outputs, self.params],
            use_bin_type=True,
        )
        return packed

    @classmethod
    def decode(cls, data: bytes) -> Request:
        rid, reply, deadline, enq, prio, inputs, outputs, params = msgpack.unpackb(data, raw=False)
        return cls(rid, reply, deadline, enq, prio, [Tensor.unpack(t) for t in inputs],
                   outputs, params)


@dataclass(slots=True)
class Reply:
    """A worker's answer to one request: outputs, or an error code and message."""

    id: str
    outputs: list[Tensor] = field(default_factory=list)
    error_code: str = ""
    error: str = ""
    batch_rows: int = 0
    queue_ms: float = 0.0
    exec_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error_code

    def encode(self) -> bytes:
        packed: bytes = msgpack.packb(
            [self.id, [t.pack() for t in self.outputs], self.error_code, self.error,
             self.batch_rows, self.queue_ms, self.exec_ms],
            use_bin_type=True,
        )
        return packed

    @classmethod
    def decode(cls, data: bytes) -> Reply:
        rid, outputs, code, error, rows, queue_ms, exec_ms = msgpack.unpackb(data, raw=False)
        return cls(rid, [Tensor.unpack(t) for t in outputs], code, error, rows, queue_ms, exec_ms)


def split_rows(array: npt.NDArray[Any], counts: list[int]) -> list[npt.NDArray[Any]]:
    """Split a batch output along axis 0 into one piece per request."""
    return np.split(array, np.cumsum(counts[:-1])) if len(counts) > 1 else [array]
