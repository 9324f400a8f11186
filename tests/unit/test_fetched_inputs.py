"""An inference loop runs inputs it fetched from their API process's bytes endpoint like
inline ones, fetching everything one read brought in one round trip, and answers at once,
unrun, a request whose bytes its API process no longer holds (workers/shared_inputs.py),
over in-memory streams."""

from __future__ import annotations

import time

import numpy as np

from api.bytes_endpoint import BytesEndpoint
from batching.errors import Unavailable
from batching.tensor_transport import FetchClient
from tests.unit.test_inference_loop import make_loop, output, replies, request
from tests.unit.test_tensor_transport import _counting
from workers.shared_inputs import SharedInputs


def test_fetched_inputs_run_and_one_given_up_is_answered_unrun(endpoint: BytesEndpoint) -> None:
    loop, streams, model = make_loop()
    client = FetchClient(5.0)
    loop.inputs = SharedInputs(fetch=client)
    fetches = _counting(endpoint)
    expiry = int(time.time() * 1000) + 60_000
    fetched, other, given_up, inline = (request(2.0, rows=2), request(3.0), request(7.0),
                                        request(5.0))
    for each in (fetched, other, given_up):
        tensor = each.inputs[0]
        tensor.ref, tensor.raw = endpoint.put(tensor.raw, expiry), b""
    assert given_up.inputs[0].ref is not None
    endpoint.free(given_up.inputs[0].ref)  # its API process gave it up before the worker read it
    for each in (fetched, other, given_up, inline):
        streams.put(each)
    loop.step()
    client.close()
    got = replies(streams)
    assert model.batches == [4]
    assert fetches == [3]
    np.testing.assert_array_equal(output(got[fetched.id], "y"), np.full((2, 4), 4.0, np.float32))
    np.testing.assert_array_equal(output(got[other.id], "y"), np.full((1, 4), 6.0, np.float32))
    np.testing.assert_array_equal(output(got[inline.id], "y"), np.full((1, 4), 10.0, np.float32))
    assert got[given_up.id].error_code == Unavailable.code
    assert "no longer holds" in got[given_up.id].error
