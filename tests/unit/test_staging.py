"""A batch is stacked into the buffer its model offers (``staging``: a GPU model's pinned
host memory), through the inference loop over in-memory streams."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from tests.unit.test_inference_loop import Arrays, make_loop, output, replies, request


class Staged:
    """Doubles ``x``; offers one buffer per input name and records whether each batch it
    ran was stacked in it."""

    def __init__(self) -> None:
        self.buffer = np.zeros(64, np.float32)
        self.offered: list[tuple[str, tuple[int, ...]]] = []
        self.in_buffer: list[bool] = []

    def staging(self, name: str, shape: tuple[int, ...],
                dtype: np.dtype[Any]) -> npt.NDArray[Any] | None:
        self.offered.append((name, shape))
        size = int(np.prod(shape))
        return self.buffer[:size].reshape(shape) if dtype == np.float32 else None

    def predict(self, inputs: Arrays) -> Arrays:
        x = inputs["x"]
        self.in_buffer.append(np.shares_memory(x, self.buffer))
        rows = x.shape[0]
        return {"y": x * 2, "batch_rows": np.full((rows, 1), rows, np.int64)}


def test_a_batch_is_stacked_into_the_buffer_its_model_offers() -> None:
    loop, streams, _ = make_loop()
    model = Staged()
    loop.model = loop.runner.model = model
    sent = [request(1.0), request(2.0, rows=2), request(3.0)]
    for each in sent:
        streams.put(each)
    loop.step()
    assert model.offered == [("x", (4, 4))] and model.in_buffer == [True]
    got = replies(streams)
    for each, value in zip(sent, (1.0, 2.0, 3.0), strict=True):
        np.testing.assert_array_equal(output(got[each.id], "y"),
                                      np.full((each.rows, 4), value * 2, np.float32))
    alone = request(5.0)  # one request: its own bytes, nothing to stack
    streams.put(alone)
    loop.step()
    assert model.in_buffer == [True, False]
    assert replies(streams)[alone.id].ok
