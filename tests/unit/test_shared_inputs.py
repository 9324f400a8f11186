"""An inference loop reads an input that an API process left in its shared-memory arena
in place, and answers at once, unrun, one whose bytes it cannot reach
(workers/shared_inputs.py), over in-memory streams."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from batching.errors import Unavailable
from batching.tensor_arena import Arena, ArenaReader
from tests.unit.test_inference_loop import make_loop, output, replies, request
from workers.inference import InferenceLoop
from workers.memory_streams import MemoryStreams
from workers.shared_inputs import SharedInputs


def _loop(directory: Path) -> tuple[InferenceLoop, MemoryStreams, list[int]]:
    """The loop, its streams, and the rows of each batch its model ran."""
    loop, streams, model = make_loop()
    loop.inputs = SharedInputs(ArenaReader(directory))
    return loop, streams, model.batches


def test_inputs_in_the_arena_run_like_inline_ones(tmp_path: Path) -> None:
    loop, streams, ran = _loop(tmp_path)
    arena = Arena(64 * 1024, tmp_path)
    shared, inline = request(3.0, rows=2), request(5.0)
    tensor = shared.inputs[0]
    tensor.ref, tensor.raw = arena.put(tensor.raw), b""
    for each in (shared, inline):
        streams.put(each)
    loop.step()
    got = replies(streams)
    assert ran == [3]
    np.testing.assert_array_equal(output(got[shared.id], "y"), np.full((2, 4), 6.0, np.float32))
    np.testing.assert_array_equal(output(got[inline.id], "y"), np.full((1, 4), 10.0, np.float32))


def test_an_input_given_up_or_out_of_reach_is_answered_unrun(tmp_path: Path) -> None:
    loop, streams, ran = _loop(tmp_path)
    arena = Arena(64 * 1024, tmp_path)
    given_up, elsewhere, fine = request(1.0), request(2.0), request(4.0)
    ref = arena.put(given_up.inputs[0].raw)
    assert ref is not None
    arena.free(ref)  # its API process gave it up before the worker read it
    given_up.inputs[0].ref, given_up.inputs[0].raw = ref, b""
    elsewhere.inputs[0].ref, elsewhere.inputs[0].raw = ["1-abcdef", 0, 16, 1], b""
    for each in (given_up, elsewhere, fine):
        streams.put(each)
    loop.step()
    got = replies(streams)
    assert ran == [1]
    assert got[fine.id].ok
    for each in (given_up, elsewhere):
        assert got[each.id].error_code == Unavailable.code
    assert "no longer holds" in got[given_up.id].error
    assert "another host" in got[elsewhere.id].error
