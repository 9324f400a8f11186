"""Strict KServe v2 input parsing, in-process: JSON types that do not fit a tensor's
datatype, bools where numbers belong, a non-string id and a loose
Inference-Header-Content-Length are 400s."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
import pytest

from api.kserve import _json_tensor, json_numbers
from batching.errors import InvalidInput
from tests.test_body import call, make_route


def infer(doc: dict[str, Any], headers: dict[str, str] | None = None,
          chunks: list[bytes] | None = None) -> tuple[int, Any]:
    route, _ = make_route()
    answer = asyncio.run(call(route, chunks or [orjson.dumps(doc)], headers=headers))
    return answer.status, answer.json()


def x(data: Any, shape: Any = None, datatype: str = "FP32", **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": datatype, "shape": shape or [1, 4],
                        "data": data}], **extra}


@pytest.mark.parametrize("doc,message", [
    (x([None, 1.0, 2.0, 3.0]), "data is not FP32: elements must be JSON numbers"),
    (x(["1.5", 1.0, 2.0, 3.0]), "data is not FP32: elements must be JSON numbers"),
    (x([True, 1.0, 2.0, 3.0]), "data is not FP32: elements must be JSON numbers"),
    (x([True, False, True, False]), "data is not FP32: elements must be JSON numbers"),
    (x([[1.0, 2.0, 3.0, True]]), "data is not FP32: elements must be JSON numbers"),
    (x([0.5] * 9999 + [True], shape=[2500, 4]), "data is not FP32: elements must be JSON numbers"),
    (x([0.5] * 9999 + [None], shape=[2500, 4]), "data is not FP32: elements must be JSON numbers"),
    (x([1.0, 2.0, 3.0, 4.0], id=7), "'id' must be a string, got int"),
    (x([1.0, 2.0, 3.0, 4.0], id=None, parameters={"timeout": True}),
     "parameters.timeout must be a non-negative number"),
    (x([1.0, 2.0, 3.0, 4.0], parameters={"priority": True}), "parameters.priority must be"),
    (x([1.0, 2.0, 3.0, 4.0], parameters={"cost": True}), "parameters.cost must be"),
])
def test_loose_json_is_400(doc: dict[str, Any], message: str) -> None:
    status, answer = infer(doc)
    assert status == 400, answer
    assert message in answer["error"]


@pytest.mark.parametrize("shape", [[True, 64], [1, 4.0], [1, -4], [1, "4"],
                                   [1, 1e30]])
def test_a_shape_element_that_is_not_an_unsigned_integer_is_400_with_tritons_text(
        shape: list[Any]) -> None:
    """The client's error, in Triton's words (Triton answers it 500)."""
    status, answer = infer(x([0.0] * 4, shape=shape))
    assert status == 400
    assert answer["error"] == ("Unable to parse 'shape': attempt to access JSON "
                               "non-unsigned-integer as unsigned-integer")


@pytest.mark.parametrize("data,shape", [
    ([0, 1, 2, 3], [1, 4]),  # integers are numbers
    ([[0.5, 1, 2, 3], [4, 5, 6, 7]], [2, 4]),  # nested lists
    ([0.0, 1.0] * 5000, [2500, 4]),  # long lists of zeros and ones
])
def test_numbers_in_any_list_form_are_taken(data: list[Any], shape: list[int]) -> None:
    status, answer = infer(x(data, shape=shape, id="req"))
    assert status == 200, answer
    assert answer["id"] == "req"
    assert np.array(answer["outputs"][0]["data"]).reshape(shape).tolist() == np.array(
        data, np.float32).reshape(shape).tolist()


@pytest.mark.parametrize("datatype,data,ok", [
    ("BOOL", [True, False], True),
    ("BOOL", [1, 0], False),
    ("INT32", [1, 2], True),
    ("INT32", [1.5, 2], False),
    ("INT32", [2**31, 0], False),
    ("INT64", [0, 1] * 3000, True),
    ("INT64", [0, 1] * 3000 + [True, 1], False),
    ("UINT8", [255, 0], True),
    ("UINT8", [-1, 0], False),
    ("UINT64", [2**64 - 1, 0], True),
    ("FP64", [1e308, 0], True),
    ("FP16", [None, 0], False),
])
def test_each_datatype_takes_only_its_json_type(datatype: str, data: list[Any], ok: bool) -> None:
    dtype = np.dtype({"BOOL": "?", "INT32": "<i4", "INT64": "<i8", "UINT8": "<u1",
                      "UINT64": "<u8", "FP64": "<f8", "FP16": "<f2"}[datatype])
    if ok:
        assert json_numbers(data, dtype).tolist() == data
    else:
        with pytest.raises((TypeError, OverflowError)):
            json_numbers(data, dtype)
        nested = [data[: len(data) // 2], data[len(data) // 2:]]
        with pytest.raises((TypeError, OverflowError)):
            json_numbers(nested, dtype)


@pytest.mark.parametrize("value", ["+111", " 111", "1_1", "-0", "0x10", "١١"])
def test_inference_header_content_length_takes_ascii_digits_only(value: str) -> None:
    status, answer = infer(x([1.0, 2.0, 3.0, 4.0]),
                           headers={"Inference-Header-Content-Length": value})
    assert status == 400
    assert "Inference-Header-Content-Length must be an integer of ASCII digits" in answer["error"]


def test_a_bad_element_is_named_by_its_input() -> None:
    status, answer = infer(x([1, 2, 3, "4"]))
    assert status == 400 and answer["error"].startswith("input 'x': data is not FP32")
    with pytest.raises(InvalidInput, match="input 'x': data is not FP32"):
        _json_tensor("x", "FP32", (1, 2), [1, None])


@pytest.mark.parametrize("value", ["\u00b2", "+5", " 5", "1_0"])
def test_job_header_lengths_take_ascii_digits_only(value: str) -> None:
    from api.job_routes import _split

    body = b'{"model":"m"}' + b"\0" * 8
    assert bytes(_split(body, "13")[0]) == b'{"model":"m"}'
    with pytest.raises(InvalidInput, match="does not fit a body"):
        _split(body, value)
