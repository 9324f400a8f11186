"""A tensor's shared memory parameters (HTTP JSON or gRPC ``InferParameter`` values alike).

An input or requested output names a registered system shared memory region with
``shared_memory_region`` and ``shared_memory_byte_size``, and optionally
``shared_memory_offset`` (bytes into the region, 0 by default). The region itself is
looked up later, by :mod:`api.shared_memory`; here only the parameters are checked.
The messages are Triton's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batching.errors import InvalidInput

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
U64_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Where a tensor's bytes lie: ``byte_size`` bytes from ``offset`` into ``region``."""

    region: str
    byte_size: int
    offset: int = 0


def tensor_ref(tensor: str, params: Mapping[str, Any]) -> ShmRef | None:
    """The region a tensor's parameters name, or None when they name none."""
    region = params.get(REGION)
    if region is None:
        for key in (OFFSET, BYTE_SIZE):
            if key in params:
                raise InvalidInput(f"'{key}' can not be specified without '{REGION}' "
                                   f"parameter for tensor '{tensor}'")
        return None
    if not isinstance(region, str):
        raise InvalidInput(f"invalid value type for '{REGION}' parameter for tensor "
                           f"'{tensor}', expected string_param.")
    if BYTE_SIZE not in params:
        raise InvalidInput(f"'{BYTE_SIZE}' must be specified along with '{REGION}' "
                           f"parameter for tensor '{tensor}'")
    return ShmRef(region, _count(tensor, BYTE_SIZE, params[BYTE_SIZE]),
                  _count(tensor, OFFSET, params.get(OFFSET, 0)))


def _count(tensor: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64_MAX:
        raise InvalidInput(f"invalid value for '{key}' parameter for tensor '{tensor}': "
                           "expected a non-negative integer")
    return value
