"""KServe v2 datatype names and their numpy equivalents, plus the BYTES wire form."""

from __future__ import annotations

import math
import struct

import numpy as np
import numpy.typing as npt

from batching.errors import InvalidInput

_NUMPY: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(np.object_),
}
_KSERVE: dict[str, str] = {dt.str if name != "BYTES" else "|O": name for name, dt in _NUMPY.items()}
DATATYPES = frozenset(_NUMPY)


def to_numpy(datatype: str) -> np.dtype[np.generic]:
    try:
        return _NUMPY[datatype]
    except KeyError:
        raise InvalidInput(
            f"unknown datatype {datatype!r}; expected one of {', '.join(sorted(_NUMPY))}"
        ) from None


def from_numpy(dtype: np.dtype[np.generic]) -> str:
    """The KServe name of a numpy dtype (byte order normalised to little-endian)."""
    if dtype.kind in "OSU":
        return "BYTES"
    name = _KSERVE.get(dtype.newbyteorder("<").str if dtype.itemsize > 1 else dtype.str)
    if name is None:
        raise InvalidInput(f"numpy dtype {dtype} has no KServe datatype")
    return name


def encode_bytes(array: npt.NDArray[np.object_]) -> bytes:
    """BYTES tensor -> concatenated 4-byte little-endian length + bytes per element."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        data = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_bytes(raw: bytes | memoryview, count: int) -> npt.NDArray[np.object_]:
    """Inverse of :func:`encode_bytes`; ``count`` elements are expected."""
    out = np.empty(count, dtype=np.object_)
    view = memoryview(raw)
    pos = 0
    for i in range(count):
        if pos + 4 > len(view):
            raise InvalidInput(f"BYTES data ends after {i} of {count} elements")
        (size,) = struct.unpack_from("<I", view, pos)
        pos += 4
        if pos + size > len(view):
            raise InvalidInput(f"BYTES element {i} claims {size} bytes past the end of the data")
        out[i] = bytes(view[pos:pos + size])
        pos += size
    if pos != len(view):
        raise InvalidInput(f"BYTES data has {len(view) - pos} bytes after {count} elements")
    return out


def to_raw(array: npt.NDArray[np.generic]) -> bytes:
    """Array -> raw little-endian bytes in row-major order (BYTES: length-prefixed)."""
    if array.dtype.kind in "OSU":
        return encode_bytes(np.asarray(array, dtype=np.object_))
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def from_raw(raw: bytes | memoryview, datatype: str, shape: tuple[int, ...]) -> npt.NDArray[np.generic]:
    count = math.prod(shape)
    if datatype == "BYTES":
        return decode_bytes(raw, count).reshape(shape)
    dtype = to_numpy(datatype)
    if len(raw) != count * dtype.itemsize:
        raise InvalidInput(
            f"{len(raw)} bytes of {datatype} data do not fill shape {list(shape)} "
            f"({count * dtype.itemsize} bytes expected)"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)
