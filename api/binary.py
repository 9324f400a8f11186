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

_LENGTH = struct.Struct("<I")


def tensor_from_buffer(name: str, datatype: str, shape: tuple[int, ...],
                       data: bytes | memoryview) -> Tensor:
    """A tensor from its raw wire bytes, checked to fill ``shape`` exactly."""
    count = math.prod(shape)
    if datatype == "BYTES":
        check_bytes(name, data, count)
    else:
        itemsize = to_numpy(datatype).itemsize
        if len(data) != count * itemsize:
            raise InvalidInput(
                f"input {name!r}: {len(data)} bytes of {datatype} data do not fill shape "
                f"{list(shape)} ({count * itemsize} bytes expected)")
        if datatype == "BOOL" and count and np.frombuffer(data, dtype=np.uint8).max() > 1:
            raise InvalidInput(f"input {name!r}: BOOL bytes must be 0 or 1")
    return Tensor(name, datatype, shape, data if isinstance(data, bytes) else bytes(data))


def check_bytes(name: str, data: bytes | memoryview, count: int) -> None:
    """Walk ``count`` length-prefixed BYTES elements; they must end exactly at the end."""
    pos = 0
    size = len(data)
    for i in range(count):
        if pos + 4 > size:
            raise InvalidInput(f"input {name!r}: BYTES data ends after {i} of {count} elements")
        (length,) = _LENGTH.unpack_from(data, pos)
        pos += 4 + length
        if pos > size:
            raise InvalidInput(f"input {name!r}: BYTES element {i} claims {length} bytes past "
                               "the end of the data")
    if pos != size:
        raise InvalidInput(f"input {name!r}: {size - pos} bytes left after {count} BYTES elements")


def raw_input(body: bytes, config: ModelConfig) -> Tensor:
    """The one input of a raw binary request (``Inference-Header-Content-Length: 0``).

    The model must have exactly one declared input; its datatype and dims come from the
    configuration. BYTES: the whole body is one element (shape ``[1, 1, ...]``). Other
    types: the body holds whole rows of the declared dims (one ``-1`` dim may be left to
    deduce, with one row).
    """
    if len(config.inputs) != 1:
        raise InvalidInput(
            f"a raw binary request (Inference-Header-Content-Length: 0) needs a model with "
            f"exactly one declared input; {config.name!r} has {len(config.inputs)}")
    spec = config.inputs[0]
    if spec.datatype == "BYTES":
        shape = (1,) * len(spec.shape)
        return Tensor(spec.name, spec.datatype, shape, _LENGTH.pack(len(body)) + body)
    itemsize = to_numpy(spec.datatype).itemsize
    inner = list(spec.shape[1:] if config.batched else spec.shape)
    free = [i for i, d in enumerate(inner) if d == -1]
    fixed = int(np.prod([d for d in inner if d != -1], dtype=np.int64)) * itemsize
    whole = config.batched or free or len(body) == fixed  # no batch dim: exactly one
    if len(free) > 1 or fixed == 0 or len(body) % fixed or not whole:
        raise InvalidInput(
            f"a raw binary request of {len(body)} bytes cannot fill input {spec.describe()}: "
            "its shape cannot be deduced from the size")
    if free:
        inner[free[0]] = len(body) // fixed
        rows = 1
    else:
        rows = len(body) // fixed
    shape = (rows, *inner) if config.batched else tuple(inner)
    return tensor_from_buffer(spec.name, spec.datatype, shape, body)


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
