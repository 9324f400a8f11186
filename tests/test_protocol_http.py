"""KServe v2 over HTTP through the official tritonclient (sync and async, JSON and binary)."""

from __future__ import annotations

import asyncio
import gzip
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeAlias, cast

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from batching.config import ADAPTIVE_BOUND_US
from tests.conftest import Stack
from tests.procs import RedisServer, wait_for
from tests.protocol_stack import (
    DATATYPES,
    assert_round_trip,
    build_repository,
    http_host,
    protocol_stack,
    sample,
)


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from protocol_stack(redis_server, logdir,
                              build_repository(tmp_path_factory.mktemp("http-repo")))


Client: TypeAlias = httpclient.InferenceServerClient


@pytest.fixture
def client(stack: Stack) -> Iterator[Client]:
    with httpclient.InferenceServerClient(http_host(stack)) as made:
        yield made


def alltypes_inputs(arrays: dict[str, np.ndarray], binary: bool,
                    module: ModuleType = httpclient) -> list[httpclient.InferInput]:
    inputs = []
    for datatype, array in arrays.items():
        item = module.InferInput(f"IN_{datatype}", list(array.shape), datatype)
        item.set_data_from_numpy(array, binary_data=binary)
        inputs.append(item)
    return inputs


def alltypes_outputs(binary: bool | None, module: ModuleType = httpclient
                     ) -> list[httpclient.InferRequestedOutput] | None:
    if binary is None:
        return None  # tritonclient then asks for every output as binary
    return [module.InferRequestedOutput(f"OUT_{d}", binary_data=binary) for d in DATATYPES]


def results(result: httpclient.InferResult) -> dict[str, np.ndarray]:
    return {d: result.as_numpy(f"OUT_{d}") for d in DATATYPES}


@pytest.mark.parametrize("binary_in,binary_out", [(True, True), (True, None), (True, False),
                                                  (False, True), (False, False)])
def test_every_datatype_round_trips(stack: Stack, client: Client, binary_in: bool,
                                    binary_out: bool | None) -> None:
    arrays = sample(rows=2, cols=3, seed=1)
    result = client.infer("alltypes", alltypes_inputs(arrays, binary_in),
                          outputs=alltypes_outputs(binary_out), request_id="rt-1")
    assert result.get_response()["id"] == "rt-1"
    assert_round_trip(arrays, results(result), json_bytes=binary_out is False)


def test_async_client_binary_and_json_with_compression(stack: Stack) -> None:
    arrays = sample(rows=3, cols=2, seed=2)

    async def run() -> list[httpclient.InferResult]:
        client = aiohttpclient.InferenceServerClient(http_host(stack))
        try:
            assert await client.is_server_ready()
            assert await client.is_model_ready("alltypes")
            calls = [client.infer("alltypes", alltypes_inputs(arrays, binary, aiohttpclient),
                                  outputs=alltypes_outputs(binary, aiohttpclient),
                                  request_compression_algorithm=algorithm,
                                  response_compression_algorithm=algorithm)
                     for binary in (True, False) for algorithm in (None, "gzip", "deflate")]
            return list(await asyncio.gather(*calls))
        finally:
            await client.close()

    answers = asyncio.run(run())
    for i, result in enumerate(answers):
        assert_round_trip(arrays, results(result), json_bytes=i >= 3)


def test_bytes_empty_and_non_ascii(stack: Stack, client: Client) -> None:
    arrays = sample(rows=1, cols=6)
    for binary in (True, False):
        result = client.infer("alltypes", alltypes_inputs(arrays, binary),
                              outputs=alltypes_outputs(binary))
        texts = result.as_numpy("OUT_BYTES").ravel().tolist()
        expected = arrays["BYTES"].ravel().tolist()
        assert texts == (expected if binary else [v.decode() for v in expected])
    assert b"" in arrays["BYTES"].ravel() and "✓".encode() in arrays["BYTES"].ravel()[1]


def test_onnx_model_without_config_matches_onnxruntime(stack: Stack, client: Client) -> None:
    x = np.random.default_rng(3).normal(size=(5, 4)).astype(np.float32)
    session = ort.InferenceSession(str(stack.repository / "onnx_mlp" / "model.onnx"))
    want_y, want_c = session.run(["Y", "C"], {"X": x})
    for binary in (True, False):
        item = httpclient.InferInput("X", [5, 4], "FP32")
        item.set_data_from_numpy(x, binary_data=binary)
        result = client.infer("onnx_mlp", [item], outputs=[
            httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("Y", "C")])
        np.testing.assert_allclose(result.as_numpy("Y"), want_y, rtol=1e-6)
        np.testing.assert_array_equal(result.as_numpy("C"), want_c)
    config = client.get_model_config("onnx_mlp")
    assert config["platform"] == "onnxruntime_onnx" and config["backend"] == "onnxruntime"
    assert config["input"] == [{"name": "X", "data_type": "TYPE_FP32", "format": "FORMAT_NONE",
                                "dims": [4]}]
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [
        ("Y", "TYPE_FP32", [3]), ("C", "TYPE_INT64", [])]


def test_raw_binary_request_without_header(stack: Stack) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    response = httpx.post(f"{stack.url}/v2/models/echo/infer", content=x.tobytes(),
                          headers={"Inference-Header-Content-Length": "0"})
    assert response.status_code == 200, response.text
    result = httpclient.InferResult.from_response_body(
        response.content, header_length=int(response.headers["Inference-Header-Content-Length"]))
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    bad = httpx.post(f"{stack.url}/v2/models/echo/infer", content=b"\0" * 10,
                     headers={"Inference-Header-Content-Length": "0"})
    assert bad.status_code == 400 and "cannot be deduced" in bad.json()["error"]


def test_gzip_body_and_gzip_answer_by_hand(stack: Stack) -> None:
    body = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}'
    response = httpx.post(f"{stack.url}/v2/models/echo/infer", content=gzip.compress(body),
                          headers={"Content-Encoding": "gzip", "Accept-Encoding": "gzip"})
    assert response.status_code == 200
    assert response.headers["content-encoding"] == "gzip"
    assert response.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]


def test_config_follows_triton_shape(stack: Stack, client: Client) -> None:
    config = client.get_model_config("echo")
    assert config["name"] == "echo" and config["backend"] == "python"
    assert config["max_batch_size"] == 32
    assert config["input"][0] == {"name": "x", "data_type": "TYPE_FP32", "format": "FORMAT_NONE",
                                  "dims": [4]}
    batching = config["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == ADAPTIVE_BOUND_US  # echo sets none
    assert batching["priority_levels"] == 3 and batching["default_priority_level"] == 2
    assert batching["default_queue_policy"]["default_timeout_microseconds"] == 30_000_000
    assert config["instance_group"] == [{"name": "echo_0", "count": 1, "kind": "KIND_CPU",
                                         "gpus": []}]
    assert config["parameters"]["delay_ms"] == {"string_value": "20"}


def test_statistics_count_requests_and_batches(stack: Stack, client: Client) -> None:
    def current() -> dict[str, Any]:
        return cast(dict[str, Any], client.get_inference_statistics("onnx_mlp")["model_stats"][0])

    # Counters of earlier tests may still be on their way (workers flush every 0.1 s).
    seen = [current()]

    def settled() -> bool:
        seen.append(current())
        return seen[-1] == seen[-2]

    wait_for(settled, 5, "settled statistics", interval=0.3)
    before = seen[-1]
    item = httpclient.InferInput("X", [3, 4], "FP32")
    item.set_data_from_numpy(np.ones((3, 4), np.float32))
    for _ in range(2):
        client.infer("onnx_mlp", [item])
    # Workers flush their counters at most 0.1 s late while busy, 1 s when idle.
    wait_for(lambda: current()["execution_count"] - before["execution_count"] == 2, 5,
             "the statistics to count both batches")
    stats = current()
    assert stats["name"] == "onnx_mlp" and stats["version"] == "1"
    assert stats["inference_count"] - before["inference_count"] == 6
    assert stats["execution_count"] - before["execution_count"] == 2
    infer = stats["inference_stats"]
    assert infer["success"]["count"] - before["inference_stats"]["success"]["count"] == 2
    assert infer["success"]["ns"] > 0
    assert abs(stats["last_inference"] / 1000 - time.time()) < 60
    for phase in ("compute_input", "compute_infer", "compute_output"):
        assert infer[phase]["count"] - before["inference_stats"][phase]["count"] == 2, phase
        assert infer[phase]["ns"] > before["inference_stats"][phase]["ns"], phase
    three = next(b for b in stats["batch_stats"] if b["batch_size"] == 3)
    assert three["compute_infer"]["count"] >= 2
    assert all(three[phase]["ns"] > 0 for phase in ("compute_input", "compute_output"))
    every = client.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in every} == {"alltypes", "echo", "onnx_mlp", "slow"}


def test_errors_map_to_statuses(stack: Stack, client: Client) -> None:
    item = httpclient.InferInput("x", [1, 4], "FP32")
    item.set_data_from_numpy(np.ones((1, 4), np.float32))
    cases: list[tuple[Callable[[], object], str, str]] = [
        (lambda: client.infer("missing", [item]), "404",
         "Request for unknown model: 'missing' is not found"),
        (lambda: client.infer("echo", [item], model_version="7"), "404",
         "Request for unknown model: 'echo' version 7 is not found"),
        (lambda: client.get_model_config("missing"), "404", "unknown model"),
        (lambda: client.get_inference_statistics("missing"), "404", "unknown model"),
        (lambda: client.get_model_metadata("missing"), "404", "unknown model"),
        (lambda: client.infer("onnx_mlp", [item]), "400",
         "unexpected inference input 'x' for model 'onnx_mlp'"),
        (lambda: client.infer("echo", [item], outputs=[httpclient.InferRequestedOutput("z")]),
         "400", "unexpected inference output 'z' for model 'echo'"),
        (lambda: client.infer("echo", [item], priority=9), "400", "priority"),
        (lambda: client.infer("slow", [item], timeout=1), "504", "deadline"),
        (lambda: client.infer("echo", [item], outputs=[
            httpclient.InferRequestedOutput("y", class_count=2)]), "400", "classification"),
        (lambda: client.load_model("missing"), "404",
         "Request for unknown model: 'missing' is not found"),
    ]
    for call, status, text in cases:
        with pytest.raises(InferenceServerException) as caught:
            call()
        assert caught.value.status() == status, caught.value
        assert text in caught.value.message()
    assert not client.is_model_ready("missing")


def test_bad_binary_bodies_are_400(stack: Stack) -> None:
    header = (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],'
              b'"parameters":{"binary_data_size":16}}]}')
    url = f"{stack.url}/v2/models/echo/infer"
    cases = [
        (header + b"\0" * 12, len(header),
         "unexpected size for input 'x', expecting 4 additional bytes for model 'echo'"),
        (header + b"\0" * 20, len(header), "unexpected additional input data for model 'echo'"),
        (header + b"\0" * 16, len(header) + 100, "does not fit a body"),
        (header + b"\0" * 16, "nope", "must be an integer"),
    ]
    for body, length, text in cases:
        response = httpx.post(url, content=body,
                              headers={"Inference-Header-Content-Length": str(length)})
        assert response.status_code == 400 and text in response.json()["error"], response.text
    bad_gzip = httpx.post(url, content=b"not gzip", headers={"Content-Encoding": "gzip"})
    assert bad_gzip.status_code == 400 and "not valid gzip" in bad_gzip.json()["error"]


def test_server_metadata_and_metrics(stack: Stack, client: Client) -> None:
    meta = client.get_server_metadata()
    assert meta["name"] == "conveyor" and "binary_tensor_data" in meta["extensions"]
    item = httpclient.InferInput("x", [1, 4], "FP32")
    for binary in (True, False):
        item.set_data_from_numpy(np.ones((1, 4), np.float32), binary_data=binary)
        client.infer("echo", [item])
    text = httpx.get(f"{stack.url}/metrics").text
    assert re.search(r'conveyor_queue_depth\{model="echo",priority="2"\} \d', text)
    assert re.search(r'conveyor_protocol_requests_total\{protocol="http_binary"\} [1-9]', text)
    assert re.search(r'conveyor_protocol_requests_total\{protocol="http_json"\} [1-9]', text)
    assert 'conveyor_oom_total{model="echo"} 0.0' in text
