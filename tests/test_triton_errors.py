"""Error texts and codes as Triton's clients and QA tests expect them (L0_http, L0_grpc,
L0_server_status, L0_output_name, L0_input_validation), over HTTP and gRPC, through
tritonclient and, where the QA tests do, plain requests and the raw gRPC stub."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import Stack
from tests.procs import RedisServer
from tests.triton_stack import ONES, grpc_url, http_url, triton_stack


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from triton_stack(redis_server, logdir, tmp_path_factory.mktemp("triton-errors"))


def simple_inputs(module: Any, *names: str) -> list[Any]:
    inputs = []
    for name in names:
        item = module.InferInput(name, [1, 16], "INT32")
        item.set_data_from_numpy(ONES)
        inputs.append(item)
    return inputs


def raised(call: Callable[[], object]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


UNKNOWN = "Request for unknown model: 'foo' is not found"
ANY_VERSION = "Request for unknown model: 'simple' version 99 is not found"
BAD_VERSION = "failed to get model version from specified version string 'x'"


def test_http_errors_in_tritons_words(stack: Stack) -> None:
    with httpclient.InferenceServerClient(http_url(stack)) as client:
        both = simple_inputs(httpclient, "INPUT0", "INPUT1")
        cases: list[tuple[Callable[[], object], str, str]] = [
            (lambda: client.get_model_metadata("foo"), "404", UNKNOWN),
            (lambda: client.get_model_config("foo"), "404", UNKNOWN),
            (lambda: client.get_inference_statistics("foo"), "404", UNKNOWN),
            (lambda: client.infer("foo", both), "404", UNKNOWN),
            (lambda: client.get_model_metadata("simple", model_version="99"), "404", ANY_VERSION),
            (lambda: client.infer("simple", both, model_version="x"), "400", BAD_VERSION),
            (lambda: client.infer("simple", simple_inputs(httpclient, "INPUT0")), "400",
             "expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], "
             "but missing required input(s) ['INPUT1']. Please provide all required input(s)."),
            (lambda: client.infer("simple", both, outputs=[
                httpclient.InferRequestedOutput("DUMMY")]), "400",
             "unexpected inference output 'DUMMY' for model 'simple'"),
            (lambda: client.infer("simple", both, outputs=[
                httpclient.InferRequestedOutput("OUTPUT0")] * 2), "400",
             "output 'OUTPUT0' already exists in request"),
            (lambda: client.get_trace_settings(), "404", "Not Found"),
        ]
        for call, status, text in cases:
            error = raised(call)
            assert (error.status(), error.message()) == (status, text) or (
                error.status() == status and error.message().startswith(text)), error


def test_grpc_errors_in_tritons_words(stack: Stack) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(stack))
    both = simple_inputs(grpcclient, "INPUT0", "INPUT1")
    cases: list[tuple[Callable[[], object], str, str]] = [
        (lambda: client.get_model_metadata("foo"), "NOT_FOUND", UNKNOWN),
        (lambda: client.infer("foo", both), "NOT_FOUND", UNKNOWN),
        (lambda: client.get_model_metadata("simple", model_version="99"), "NOT_FOUND",
         ANY_VERSION),
        (lambda: client.infer("simple", both, model_version="x"), "INVALID_ARGUMENT", BAD_VERSION),
        (lambda: client.infer("simple", both, outputs=[
            grpcclient.InferRequestedOutput("OUTPUT0")] * 2), "INVALID_ARGUMENT",
         "output 'OUTPUT0' already exists in request"),
        (lambda: client.infer("simple", both, outputs=[
            grpcclient.InferRequestedOutput("DUMMY")]), "INVALID_ARGUMENT",
         "unexpected inference output 'DUMMY' for model 'simple'"),
        (lambda: client.infer("simple", simple_inputs(grpcclient, "INPUT0")), "INVALID_ARGUMENT",
         "expected 2 inputs but got 1 inputs for model 'simple'"),
    ]
    for call, status, text in cases:
        error = raised(call)
        assert error.status() == f"StatusCode.{status}", error
        assert error.message().startswith(text), error
    assert client.is_server_live()
    client.close()


def test_grpc_byte_sizes_are_checked_in_tritons_words(stack: Stack) -> None:
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
    request.raw_input_contents.extend([ONES.tobytes(), ONES.tobytes() * 2])
    with grpc.insecure_channel(grpc_url(stack)) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request, timeout=10)
    error: Any = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == ("input byte size mismatch for input 'INPUT1' for model 'simple'. "
                               "Expected 64, got 128")


def post(stack: Stack, model: str, payload: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{stack.url}/v2/models/{model}/infer", headers=headers,
                      content=payload if isinstance(payload, bytes) else json.dumps(payload))


def simple_json(first: list[int], second: list[int] | None = None) -> dict[str, Any]:
    inputs = [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": first}]
    if second is not None:
        inputs.append({"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": second})
    return {"inputs": inputs}


def test_json_data_that_does_not_fill_its_shape(stack: Stack) -> None:
    """L0_http's curl checks: the whole body is Triton's error object."""
    short = post(stack, "simple", simple_json(list(range(1, 16))))
    assert short.status_code == 400
    assert short.text == '{"error":"Failed to parse \'data\' field: shape does not match true shape"}'
    long = post(stack, "simple", simple_json(list(range(1, 19))))
    assert long.status_code == 400
    assert long.text == ('{"error":"Unable to parse \'data\': Shape does not match true shape of '
                         '\'data\' field"}')
    fine = post(stack, "simple", simple_json(list(range(1, 17)), list(range(1, 17))))
    assert fine.status_code == 200
    assert fine.json()["outputs"][0]["data"] == list(range(2, 33, 2))


def test_shapes_that_overflow_or_are_negative(stack: Stack) -> None:
    def one(shape: list[int]) -> dict[str, Any]:
        return {"inputs": [{"name": "INPUT0", "shape": shape, "datatype": "FP32", "data": [1.0]}]}

    count = post(stack, "simple", one([2**4, 2**60 + 2]))
    assert count.status_code == 400
    assert "causes total element count to exceed maximum size of" in count.json()["error"]
    size = post(stack, "simple", one([2**2, 2**60 + 2]))
    assert size.status_code == 400
    assert "byte size overflow for input 'INPUT0'" in size.json()["error"]
    negative = post(stack, "simple", one([2, -5]))
    assert negative.status_code == 400  # the client's error (Triton answers 500)
    assert negative.json()["error"] == ("Unable to parse 'shape': attempt to access JSON "
                                        "non-unsigned-integer as unsigned-integer")


def nested(depth: int, value: Any) -> Any:
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("model,datatype,value,shape", [
    ("strings", "BYTES", "hello", [1, 1]),
    ("simple", "INT32", list(range(16)), [1, 16]),
])
def test_json_nesting_depth_is_limited_to_100(stack: Stack, model: str, datatype: str,
                                              value: Any, shape: list[int]) -> None:
    def body(depth: int) -> dict[str, Any]:
        item = {"name": "INPUT0", "datatype": datatype, "shape": shape,
                "data": nested(depth, value)}
        return {"inputs": [item, {**item, "name": "INPUT1"}] if model == "simple" else [item]}

    deep = post(stack, model, body(120))
    assert deep.status_code == 400
    assert "JSON nesting depth exceeds maximum allowed limit (100)" in deep.json()["error"]
    assert post(stack, model, body(50)).status_code == 200


def test_raw_bytes_request_needs_an_input_of_shape_1(stack: Stack) -> None:
    response = post(stack, "strings", b"427", **{"Inference-Header-Content-Length": "0"})
    assert response.status_code == 400
    assert ("For BYTE datatype raw input 'INPUT0', the model must have input shape [1]"
            in response.json()["error"])
    several = post(stack, "simple", np.arange(16, dtype=np.int32).tobytes(),
                   **{"Inference-Header-Content-Length": "0"})
    assert several.status_code == 400
    assert several.json()["error"].startswith(
        "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in "
        "'simple' model configuration")


@pytest.mark.parametrize("listed", [True, False])
def test_bytes_that_are_not_utf8_are_an_error_as_json_and_intact_as_binary(
        stack: Stack, listed: bool) -> None:
    """Not U+FFFD in place of the bytes: JSON cannot carry them, binary can (tritonclient
    asks for every output as binary when it lists none)."""
    data = np.array([[b"ok", b"\xff\xfe"]], dtype=np.object_)
    with httpclient.InferenceServerClient(http_url(stack)) as client:
        item = httpclient.InferInput("INPUT0", [1, 2], "BYTES")
        item.set_data_from_numpy(data, binary_data=True)
        error = raised(lambda: client.infer("strings", [item], outputs=[
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]))
        assert error.status() == "400"
        assert "not valid UTF-8" in error.message() and '"binary_data": true' in error.message()
        result = client.infer("strings", [item], outputs=[
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)] if listed else None)
        assert list(result.as_numpy("OUTPUT0").ravel()) == [b"ok", b"\xff\xfe"]


def test_aio_clients_see_the_same_texts_and_codes(stack: Stack) -> None:
    async def run() -> None:
        http = aiohttpclient.InferenceServerClient(http_url(stack))
        grpc_client = aiogrpcclient.InferenceServerClient(grpc_url(stack))
        try:
            for client, module, not_found, invalid in (
                    (http, aiohttpclient, "404", "400"),
                    (grpc_client, aiogrpcclient, "StatusCode.NOT_FOUND",
                     "StatusCode.INVALID_ARGUMENT")):
                both = simple_inputs(module, "INPUT0", "INPUT1")
                with pytest.raises(InferenceServerException) as caught:
                    await client.infer("foo", both)
                assert (caught.value.status(), caught.value.message()) == (not_found, UNKNOWN)
                with pytest.raises(InferenceServerException) as caught:
                    await client.infer("simple", both, outputs=[
                        module.InferRequestedOutput("OUTPUT0")] * 2)
                assert caught.value.status() == invalid
                assert caught.value.message() == "output 'OUTPUT0' already exists in request"
        finally:
            await http.close()
            await grpc_client.close()

    asyncio.run(run())
