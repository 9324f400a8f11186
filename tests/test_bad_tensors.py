"""Tensors a client got wrong are its error, 400 (gRPC ``INVALID_ARGUMENT``), with a message
that says what was wrong: JSON numbers beyond their datatype's range (numpy would make a
float infinite and refuses an integer) and shape dimensions outside 0..INT64_MAX."""

from __future__ import annotations

import asyncio
import re
import struct
from typing import Any

import numpy as np
import orjson
import pytest

from api.kserve import json_numbers
from batching.config import ModelConfig
from batching.errors import InvalidInput
from batching.signature import INT64_MAX, check_inputs
from tests.test_body import call, make_route

FP32_RANGE = "elements must lie in -3.4028234663852886e+38..3.4028234663852886e+38"
FP16_RANGE = "elements must lie in -65504.0..65504.0"
INT64_RANGE = f"elements must lie in {-INT64_MAX - 1}..{INT64_MAX}"


@pytest.mark.parametrize("data,dtype,message", [
    ([1e39], "float32", FP32_RANGE),
    ([-1e39, 1.0], "float32", FP32_RANGE),
    ([[1.0], [1e39]], "float32", FP32_RANGE),
    ([0.5] * 299 + [1e39], "float32", FP32_RANGE),  # long lists are read by numpy first
    ([70000.0], "float16", FP16_RANGE),
    ([70000], "float16", FP16_RANGE),
    ([[1.0, -70000.0]], "float16", FP16_RANGE),
    ([300], "uint8", "elements must lie in 0..255"),
    ([300], "int8", "elements must lie in -128..127"),
    ([[-129]], "int8", "elements must lie in -128..127"),
    ([-1], "uint64", "elements must lie in 0..18446744073709551615"),
    ([2**63], "int64", INT64_RANGE),
    ([[2**63]], "int64", INT64_RANGE),
    ([[-1, 2**63]], "int64", INT64_RANGE),  # numpy reads these as floats
])
def test_json_numbers_beyond_the_datatype_are_refused(data: list[Any], dtype: str,
                                                      message: str) -> None:
    with pytest.raises(OverflowError, match=f"^{re.escape(message)}$"):
        json_numbers(data, np.dtype(dtype))


@pytest.mark.parametrize("data,dtype", [
    ([3.4028234663852886e38, -3.4028234663852886e38], "float32"),
    ([65504.0, -65504], "float16"),
    ([1e39], "float64"),
    ([255, 0], "uint8"),
    ([[-128, 127]], "int8"),
    ([2**63 - 1, -2**63], "int64"),
    ([2**64 - 1], "uint64"),
])
def test_json_numbers_at_the_edge_of_the_range_are_taken(data: list[Any], dtype: str) -> None:
    array = json_numbers(data, np.dtype(dtype))
    assert array.dtype == np.dtype(dtype)
    assert array.ravel().tolist() == np.asarray(data, dtype=np.dtype(dtype)).ravel().tolist()
    assert np.isfinite(array).all()


OPEN = ModelConfig.from_dict("open", {"backend": "python", "max_batch_size": 0})
"""No declared signature: any shape passes the signature checks."""


@pytest.mark.parametrize("shape", [(1, -4), (-1,), (2, 2**63), (0, 2**63)])
def test_a_shape_dimension_outside_int64_is_refused_on_every_protocol(
        shape: tuple[int, ...]) -> None:
    """gRPC shapes are int64 (negative ones arrive as they are); JSON's come through the
    same check (a zero dimension lets the element count pass)."""
    shown = "[" + ",".join(map(str, shape)) + "]"
    with pytest.raises(InvalidInput) as refused:
        check_inputs(OPEN, [("x", "FP32", shape)])
    assert refused.value.message == (f"input 'x': shape {shown} has a dimension outside "
                                     f"0..{INT64_MAX}")
    assert (refused.value.http_status, refused.value.grpc_status) == (400, "INVALID_ARGUMENT")


# --- through the HTTP infer route, in process -----------------------------------------------


def post(body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    route, _ = make_route()
    answer = asyncio.run(call(route, [body], headers=headers))
    return answer.status, answer.json()


def x(data: Any, shape: list[int], datatype: str = "FP32") -> bytes:
    return orjson.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": shape,
                                     "data": data}]})


def test_an_fp32_beyond_its_range_is_400_not_infinity() -> None:
    status, answer = post(x([1.0, 2.0, 3.0, 1e39], [1, 4]))
    assert (status, answer) == (400, {"error": f"input 'x': data is not FP32: {FP32_RANGE}"})


def test_a_huge_dimension_beside_a_zero_one_is_400_in_json_and_binary() -> None:
    status, answer = post(x([], [0, 2**63]))
    assert status == 400 and "has a dimension outside 0..9223372036854775807" in answer["error"]
    header = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [0, 2**63],
                                       "parameters": {"binary_data_size": 0}}]})
    status, answer = post(header, {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "has a dimension outside 0..9223372036854775807" in answer["error"]


def test_binary_fp32_needs_no_range_check() -> None:
    """Raw bytes are FP32 already: the largest finite one passes as it is."""
    header = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                       "parameters": {"binary_data_size": 16}}]})
    body = header + struct.pack("<4f", 3.4028234663852886e38, 0, 0, 0)
    status, _ = post(body, {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200
