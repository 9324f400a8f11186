"""The binary tensor extension's byte-level pieces: raw tensors, raw requests, compressed
responses (request bodies are inflated by :mod:`api.body`).

Binary tensors are little-endian, row-major, unpadded; BOOL is one byte (0 or 1); a BYTES
element is a 4-byte little-endian length and then its bytes. That is also the form a
:class:`~batching.envelope.Tensor` carries through Redis, so a binary input goes into the
envelope as it arrived (after a size check and, for BYTES and BOOL, a scan of the
lengths or values) and a binary output is sent back without ever becoming a list.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from typing import Any

import numpy as np

from batching.config import ModelConfig
from batching.datatypes import to_numpy
from batching.envelope import Tensor
from batching.errors import InvalidInput
from batching.signature import dims

_LENGTH = struct.Struct("<I")


def tensor_from_buffer(name: str, datatype: str, shape: tuple[int, ...],
                       data: bytes | memoryview, model: str = "") -> Tensor:
    """A tensor from its raw wire bytes, checked to fill ``shape`` exactly (``model``
    names the model in the messages)."""
    count = math.prod(shape)
    if datatype == "BYTES":
        check_bytes(name, data, count, model)
    else:
        itemsize = to_numpy(datatype).itemsize
        if len(data) != count * itemsize:
            raise InvalidInput(
                f"input byte size mismatch for input '{name}'{_for(model)}. Expected "
                f"{count * itemsize}, got {len(data)}")
        if datatype == "BOOL" and count and np.frombuffer(data, dtype=np.uint8).max() > 1:
            raise InvalidInput(f"input {name!r}: BOOL bytes must be 0 or 1")
    return Tensor(name, datatype, shape, data if _immutable(data) else bytes(data))


def _immutable(data: bytes | memoryview) -> bool:
    """``data`` cannot change: bytes, or a view of bytes (a slice of a request body, kept
    as it is: copying it cost the API 10-15 µs a 150 KB input)."""
    return isinstance(data, bytes) or isinstance(data.obj, bytes)


def check_bytes(name: str, data: bytes | memoryview, count: int, model: str = "") -> None:
    """Walk ``count`` length-prefixed BYTES elements; they must end exactly at the end."""
    where = f"inference input '{name}'{_for(model)}"
    pos = 0
    size = len(data)
    found = 0
    while pos < size:
        if size - pos < 4:
            raise InvalidInput(f"incomplete string length indicator for {where}, expecting 4 "
                               f"bytes but only {size - pos} bytes available")
        found += 1
        if found > count:
            raise InvalidInput(f"unexpected number of string elements {found} for {where}, "
                               f"expecting {count}")
        (length,) = _LENGTH.unpack_from(data, pos)
        pos += 4 + length
        if pos > size:
            raise InvalidInput(f"BYTES element {found - 1} of {where} claims {length} bytes, "
                               "past the end of the data")
    if found != count:
        raise InvalidInput(f"expected {count} string elements for {where}, got {found}")


def _for(model: str) -> str:
    return f" for model '{model}'" if model else ""


def raw_input(body: bytes, config: ModelConfig) -> Tensor:
    """The one input of a raw binary request (``Inference-Header-Content-Length: 0``).

    The model must have exactly one declared input; its datatype and dims come from the
    configuration, which may leave at most one dim (besides the batch dim) variable.
    BYTES: the whole body is one element, so the input must have the dims ``[1]``. Other
    types: the body holds whole rows of the declared dims (a ``-1`` dim is deduced, with
    one row).
    """
    if len(config.inputs) != 1:
        raise InvalidInput(
            f"Raw request must only have 1 input (found 1) to be deduced but got "
            f"{len(config.inputs)} inputs in '{config.name}' model configuration")
    spec = config.inputs[0]
    inner = list(spec.shape[1:] if config.batched else spec.shape)
    free = [i for i, d in enumerate(inner) if d == -1]
    if len(free) > 1:
        raise InvalidInput(f"The shape of the raw input '{spec.name}' can not be deduced "
                           "because there are more than one variable-sized dimension")
    if spec.datatype == "BYTES":
        if free or math.prod(inner) != 1:
            raise InvalidInput(f"For BYTE datatype raw input '{spec.name}', the model must "
                               f"have input shape [1] (it has {dims(inner)})")
        shape = (1,) * len(spec.shape)
        return Tensor(spec.name, spec.datatype, shape, _LENGTH.pack(len(body)) + body)
    itemsize = to_numpy(spec.datatype).itemsize
    fixed = int(np.prod([d for d in inner if d != -1], dtype=np.int64)) * itemsize
    whole = config.batched or free or len(body) == fixed  # no batch dim: exactly one
    if fixed == 0 or len(body) % fixed or not whole:
        raise InvalidInput(
            f"a raw binary request of {len(body)} bytes cannot fill input {spec.describe()}: "
            "its shape cannot be deduced from the size")
    if free:
        inner[free[0]] = len(body) // fixed
        rows = 1
    else:
        rows = len(body) // fixed
    shape = (rows, *inner) if config.batched else tuple(inner)
    return tensor_from_buffer(spec.name, spec.datatype, shape, body, config.name)


def compress(body: bytes, accept: str) -> tuple[bytes, str | None]:
    """Compress a response as ``Accept-Encoding`` asks: gzip or deflate, preferring gzip."""
    wanted = _accepted(accept)
    if "gzip" in wanted:
        return gzip.compress(body, compresslevel=1), "gzip"
    if "deflate" in wanted:
        return zlib.compress(body, 1), "deflate"
    return body, None


def _accepted(accept: str) -> set[str]:
    found: set[str] = set()
    for part in accept.split(","):
        token, _, params = part.strip().partition(";")
        quality: Any = params.strip().removeprefix("q=") if params.strip().startswith("q=") else "1"
        try:
            if float(quality) > 0:
                found.add(token.strip().lower())
        except ValueError:
            continue
    return found
