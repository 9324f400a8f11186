"""While the model runs, a next batch that is already full is formed and stacked on the
loop's thread (``InferenceLoop._prepare``), so that the model starts it the moment it
frees: for a model that stacks into a buffer of its own (``staging``, pinned memory on a
GPU). A batch that could still grow is left to form when the model frees."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from tests.unit.test_inference_pipeline import (
    ROWS,
    Sleepy,
    make_loop,
    replies,
    request,
    run_until_idle,
)
from workers.inference import InferenceLoop
from workers.memory_streams import MemoryStreams


class Staging(Sleepy):
    """A sleepy model that offers buffers to stack into, and records when each batch was
    stacked, on which thread, and whether the batch it then ran was the one stacked."""

    def __init__(self, streams: MemoryStreams) -> None:
        super().__init__(streams)
        self.stacked: list[tuple[float, str]] = []
        self.buffers: list[npt.NDArray[Any]] = []
        self.ran_stacked: list[bool] = []

    def staging(self, name: str, shape: tuple[int, ...],
                dtype: np.dtype[Any]) -> npt.NDArray[Any] | None:
        self.stacked.append((time.monotonic(), threading.current_thread().name))
        self.buffers.append(np.empty(shape, dtype))
        return self.buffers[-1]

    def predict(self, inputs: dict[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        self.ran_stacked.append(any(inputs["x"] is b for b in self.buffers))
        return super().predict(inputs)


class WaitsForTheNext(Staging):
    """A staging model whose every batch waits, before it runs, until the batch after it
    (of ``BATCHES``) has been stacked, or ``WAIT_S`` has passed: the next batch is
    stacked while the model runs however slowly the host schedules the loop's thread."""

    BATCHES = 3
    WAIT_S = 10.0

    def __init__(self, streams: MemoryStreams) -> None:
        super().__init__(streams)
        self._changed = threading.Condition()

    def staging(self, name: str, shape: tuple[int, ...],
                dtype: np.dtype[Any]) -> npt.NDArray[Any] | None:
        with self._changed:
            buffer = super().staging(name, shape, dtype)
            self._changed.notify_all()
        return buffer

    def predict(self, inputs: dict[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        wanted = min(len(self.batches) + 2, self.BATCHES)
        with self._changed:
            self._changed.wait_for(lambda: len(self.stacked) >= wanted, self.WAIT_S)
        return super().predict(inputs)


def _loop(model_type: type[Staging] = Staging) -> tuple[InferenceLoop, MemoryStreams, Staging]:
    loop, streams, model = make_loop(model_type=model_type)
    assert isinstance(model, Staging)
    return loop, streams, model


def test_a_full_next_batch_is_stacked_while_the_model_runs() -> None:
    loop, streams, model = _loop(WaitsForTheNext)
    sent = [request(float(i)) for i in range(3 * ROWS)]
    for each in sent:
        streams.put(each)
    run_until_idle(loop)
    assert model.batches == [ROWS] * 3 and model.ran_stacked == [True] * 3
    loop_thread = threading.current_thread().name
    # The first batch is stacked by whichever thread starts it (a race of no consequence);
    # the two after it, while the model runs, on the loop's.
    assert [thread for _, thread in model.stacked][1:] == [loop_thread, loop_thread]
    for i in (1, 2):  # stacked before the batch ahead of it had left the model
        assert model.stacked[i][0] < model.starts[i - 1] + model.slept[i - 1]
    got = replies(streams)
    for each in sent:
        np.testing.assert_array_equal(next(t.array() for t in got[each.id].outputs),
                                      each.inputs[0].array() * 2)


def test_a_next_batch_that_can_still_grow_waits_for_the_model() -> None:
    loop, streams, model = _loop()
    for i in range(ROWS + 2):
        streams.put(request(float(i)))
    loop.step()  # launches the first, full batch
    for i in range(3):  # arrive while it runs: the next batch takes them in
        streams.put(request(float(100 + i)))
    run_until_idle(loop)
    assert model.batches == [ROWS, 5]
    assert all(thread == "model-sleepy" for _, thread in model.stacked)
    assert len(replies(streams)) == ROWS + 5
