"""A batch's rows that already lie one after another in one buffer, as one array, uncopied.

The inputs of a batch fetched from one API process arrive in one buffer, in the order the
batch takes them (batching/tensor_transport.py), and so do entries placed side by side in
a tensor arena: stacking them would copy every byte (150 KB a request for an image) into
an array whose bytes are those already there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


def adjacent(parts: list[npt.NDArray[Any]], raws: list[bytes | memoryview]
             ) -> npt.NDArray[Any] | None:
    """``np.concatenate(parts)`` as a view, when each of ``parts`` views its ``raws`` (all
    slices of one buffer) and each begins where the one before ends; None otherwise."""
    first = raws[0]
    if not isinstance(first, memoryview) or len(parts) < 2 or not parts[0].ndim:
        return None
    owner = first.obj
    dtype, inner = parts[0].dtype, parts[0].shape[1:]
    end = None
    for part, raw in zip(parts, raws, strict=True):
        if (not isinstance(raw, memoryview) or raw.obj is not owner or part.dtype != dtype
                or part.shape[1:] != inner or not part.flags.c_contiguous):
            return None
        start = part.__array_interface__["data"][0]
        if end is not None and start != end:
            return None
        end = start + part.nbytes
    try:
        whole = np.frombuffer(memoryview(owner).cast("B"), np.uint8)
    except (ValueError, TypeError, BufferError):  # a buffer numpy cannot take flat
        return None
    offset = parts[0].__array_interface__["data"][0] - whole.__array_interface__["data"][0]
    rows = sum(part.shape[0] for part in parts)
    size = sum(part.nbytes for part in parts)
    joined: npt.NDArray[Any] = whole[offset:offset + size].view(dtype).reshape((rows, *inner))
    return joined
