"""Stacking a batch whose rows already lie in order in one buffer (fetched together) views
that buffer; anything else is copied, as ``np.concatenate`` would."""

from __future__ import annotations

import numpy as np

from batching.contiguous import adjacent
from batching.envelope import Request, Tensor
from batching.former import Batch, Entry


def fetched(rows: list[int], inner: tuple[int, ...] = (2, 3)) -> tuple[memoryview, list[Tensor]]:
    """One buffer holding requests of ``rows`` rows each, one after another, as a fetch
    delivers them; a tensor viewing each request's slice of it."""
    size = int(np.prod(inner))
    buffer = np.arange(sum(rows) * size, dtype=np.float32).view(np.uint8)
    body = buffer.data
    tensors, at = [], 0
    for n in rows:
        length = n * size * 4
        tensors.append(Tensor("x", "FP32", (n, *inner), body[at:at + length]))
        at += length
    return body, tensors


def batch_of(tensors: list[Tensor]) -> Batch:
    return Batch([Entry("s", f"{i}-0", Request(str(i), "r", 0, 0, 1, [t]), 0.0)
                  for i, t in enumerate(tensors)], "full")


def test_rows_in_order_in_one_buffer_are_stacked_uncopied() -> None:
    body, tensors = fetched([1, 3, 2])
    stacked = batch_of(tensors).stacked_inputs()["x"]
    expected = np.concatenate([t.array() for t in tensors])
    assert stacked.shape == (6, 2, 3) and np.array_equal(stacked, expected)
    assert np.shares_memory(stacked, np.frombuffer(body, np.uint8))


def test_rows_out_of_order_or_apart_are_copied() -> None:
    _, tensors = fetched([1, 1, 1])
    reordered = batch_of([tensors[2], tensors[0], tensors[1]]).stacked_inputs()["x"]
    assert np.array_equal(reordered, np.concatenate([tensors[i].array() for i in (2, 0, 1)]))
    gap = batch_of([tensors[0], tensors[2]]).stacked_inputs()["x"]
    assert np.array_equal(gap, np.concatenate([tensors[0].array(), tensors[2].array()]))
    for stacked in (reordered, gap):
        assert not any(np.shares_memory(stacked, t.array()) for t in tensors)


def test_rows_of_different_buffers_or_bytes_are_not_joined() -> None:
    _, first = fetched([1])
    _, second = fetched([1])
    parts = [t.array() for t in (*first, *second)]
    assert adjacent(parts, [t.raw for t in (*first, *second)]) is None
    owned = [Tensor.from_array("x", np.zeros((1, 2), np.float32)) for _ in range(2)]
    assert adjacent([t.array() for t in owned], [t.raw for t in owned]) is None
