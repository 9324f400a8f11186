"""The HTTP codec without processes: binary tensors, raw requests, compression, rendering."""

from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import replace
from typing import Any

import grpc
import numpy as np
import orjson
import pytest

from api.binary import compress, raw_input, tensor_from_buffer
from api.kserve import InferRequest, parse_header, render
from batching.config import ModelConfig
from batching.envelope import Tensor
from batching.errors import InvalidInput, status_table

CONFIG = ModelConfig.from_dict("m", {
    "backend": "python", "max_batch_size": 8,
    "inputs": [{"name": "a", "datatype": "FP32", "shape": [-1, 2]},
               {"name": "s", "datatype": "BYTES", "shape": [-1, 1]}],
    "outputs": [{"name": "o", "datatype": "FP32", "shape": [-1, 2]}]})


def single(datatype: str, shape: list[int]) -> ModelConfig:
    return ModelConfig.from_dict("one", {"backend": "python", "inputs": [
        {"name": "in", "datatype": datatype, "shape": shape}]})


def strings(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


def test_header_then_binary_inputs_in_order() -> None:
    a = np.arange(4, dtype=np.float32).reshape(2, 2)
    s = strings(b"", "é".encode())
    header = orjson.dumps({"id": "r", "inputs": [
        {"name": "a", "datatype": "FP32", "shape": [2, 2], "parameters": {"binary_data_size": 16}},
        {"name": "s", "datatype": "BYTES", "shape": [2, 1],
         "parameters": {"binary_data_size": len(s)}}],
        "outputs": [{"name": "o", "parameters": {"binary_data": True}}]})
    parsed = parse_header(header, memoryview(a.tobytes() + s), CONFIG)
    assert parsed.rows == 2 and parsed.id == "r" and parsed.binary("o")
    np.testing.assert_array_equal(parsed.inputs[0].array(), a)
    assert list(parsed.inputs[1].array().ravel()) == [b"", "é".encode()]


def test_a_binary_input_views_its_body_and_copies_what_may_change() -> None:
    body = np.arange(8, dtype=np.float32).tobytes() + b"tail"
    kept = tensor_from_buffer("t", "FP32", (2, 4), memoryview(body)[:32])
    assert isinstance(kept.raw, memoryview) and kept.raw.obj is body  # not copied
    mutable = bytearray(body)
    copied = tensor_from_buffer("t", "FP32", (2, 4), memoryview(mutable)[:32])
    mutable[:4] = b"\xff" * 4
    assert isinstance(copied.raw, bytes) and copied.array()[0, 0] == 0.0


@pytest.mark.parametrize("datatype,shape,data,message", [
    ("FP32", (1, 2), b"\0" * 7,
     "input byte size mismatch for input 't' for model 'm'. Expected 8, got 7"),
    ("BOOL", (1, 2), b"\x01\x02", "BOOL bytes must be 0 or 1"),
    ("BYTES", (1, 1), strings(b"ab") + b"x", "incomplete string length indicator for inference "
     "input 't' for model 'm', expecting 4 bytes but only 1 bytes available"),
    ("BYTES", (1, 1), strings(b"ab", b"c"), "unexpected number of string elements 2 for "
     "inference input 't' for model 'm', expecting 1"),
    ("BYTES", (1, 2), strings(b"ab"),
     "expected 2 string elements for inference input 't' for model 'm', got 1"),
    ("BYTES", (1, 1), struct.pack("<I", 9) + b"abc", "claims 9 bytes, past the end"),
])
def test_bad_binary_tensors(datatype: str, shape: tuple[int, ...], data: bytes,
                            message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        tensor_from_buffer("t", datatype, shape, data, "m")
    assert message in caught.value.message


def test_raw_input_deduces_rows_or_one_free_dim() -> None:
    rows = raw_input(np.zeros((3, 4), np.float32).tobytes(), single("FP32", [-1, 4]))
    assert rows.shape == (3, 4)
    free = raw_input(np.zeros(6, np.int16).tobytes(), single("INT16", [-1, 2, -1]))
    assert free.shape == (1, 2, 3)
    text = raw_input("ü".encode(), single("BYTES", [-1, 1]))
    assert text.shape == (1, 1) and text.array()[0, 0] == "ü".encode()
    with pytest.raises(InvalidInput, match="cannot be deduced"):
        raw_input(b"\0" * 5, single("FP32", [-1, 4]))


@pytest.mark.parametrize("config,message", [
    (CONFIG, "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in "
             "'m' model configuration"),
    (single("BYTES", [-1, -1]), "For BYTE datatype raw input 'in', the model must have input "
                                "shape [1]"),
    (single("BYTES", [-1, 2]), "For BYTE datatype raw input 'in', the model must have input "
                               "shape [1]"),
    (single("FP16", [-1, -1, -1]), "The shape of the raw input 'in' can not be deduced because "
                                   "there are more than one variable-sized dimension"),
])
def test_raw_input_refusals_in_tritons_words(config: ModelConfig, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        raw_input(b"1234", config)
    assert message in caught.value.message


def test_raw_input_of_a_model_without_a_batch_dim_is_exactly_its_shape() -> None:
    config = replace(single("FP32", [3, 2]), max_batch_size=0)
    whole = raw_input(np.zeros((3, 2), np.float32).tobytes(), config)
    assert whole.shape == (3, 2)
    with pytest.raises(InvalidInput, match="cannot be deduced"):
        raw_input(np.zeros((2, 3, 2), np.float32).tobytes(), config)
    free = raw_input(np.zeros(8, np.float32).tobytes(),
                     replace(single("FP32", [-1, 2]), max_batch_size=0))
    assert free.shape == (4, 2)


def test_response_compression() -> None:
    body = b"x" * 1000
    assert gzip.decompress(compress(body, "gzip")[0]) == body
    packed, encoding = compress(body, "deflate;q=0.5, gzip;q=0")
    assert encoding == "deflate" and zlib.decompress(packed) == body
    assert compress(body, "identity") == (body, None)


def test_render_mixes_json_and_binary_outputs() -> None:
    """A listed output is binary only when its own binary_data says so: binary_data_output
    applies to the outputs of a request that lists none (Triton, and its L0_http test)."""
    def parsed(**extra: Any) -> InferRequest:
        return parse_header(orjson.dumps({
            "inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]},
                       {"name": "s", "datatype": "BYTES", "shape": [1, 1], "data": ["z"]}],
            "parameters": {"binary_data_output": True}, **extra}), memoryview(b""), CONFIG)

    out = Tensor.from_array("o", np.array([[1.5, 2.5]], np.float32))
    other = Tensor.from_array("p", np.ones((1, 1)))
    body, length = render("m", parsed(outputs=[{"name": "o", "parameters": {"binary_data": True}}]),
                          [out, other])
    assert length is not None
    header = orjson.loads(body[:length])
    assert header["outputs"] == [{"name": "o", "datatype": "FP32", "shape": [1, 2],
                                  "parameters": {"binary_data_size": 8}}]
    assert body[length:] == out.raw
    body, length = render("m", parsed(outputs=[{"name": "o"}]), [out, other])
    assert length is None and orjson.loads(body)["outputs"][0]["data"] == [1.5, 2.5]
    body, length = render("m", parsed(), [out, other])
    assert length is not None and body[length:] == bytes(out.raw) + bytes(other.raw)
    request = parsed()
    request.binary_default = False
    body, length = render("m", request, [out])
    assert length is None and orjson.loads(body)["outputs"][0]["data"] == [1.5, 2.5]


def test_bytes_that_are_not_utf8_are_refused_as_json_not_replaced() -> None:
    request = parse_header(orjson.dumps({
        "inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]},
                   {"name": "s", "datatype": "BYTES", "shape": [1, 1], "data": ["z"]}]}),
        memoryview(b""), CONFIG)
    bad = Tensor.from_array("o", np.array([[b"ok", b"\xff\xfe"]], dtype=np.object_), "BYTES")
    with pytest.raises(InvalidInput, match="'o' holds BYTES that are not valid UTF-8"):
        render("m", request, [bad])
    request.binary_default = True
    body, length = render("m", request, [bad])
    assert length is not None and b"\xff\xfe" in body[length:]


def test_every_error_maps_to_a_grpc_status_code() -> None:
    table = status_table()
    assert {code: http for code, (http, _) in table.items()} == {
        "internal": 500, "invalid_input": 400, "not_found": 404, "overloaded": 503,
        "unavailable": 503, "deadline_exceeded": 504, "model_failure": 500,
        "unauthenticated": 401, "permission_denied": 403, "payload_too_large": 413,
        "model_control_disabled": 503, "request_timeout": 408, "headers_too_large": 431,
        "unsupported": 501, "already_exists": 400, "region_not_found": 404,
        "too_many_regions": 400, "malformed_shape": 400,
        "files_refused": 500}
    for _, name in table.values():
        assert isinstance(grpc.StatusCode[name], grpc.StatusCode)
