"""KServe v2 / Triton over gRPC through the official tritonclient (sync, async and streaming).

Never import ``api.proto`` here: it declares the same ``inference.*`` protobuf symbols as
``tritonclient.grpc``, and one process's descriptor pool cannot hold both.
"""

from __future__ import annotations

import asyncio
import queue
import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import MakeStack, Stack
from tests.procs import RedisServer, free_port, wait_for
from tests.protocol_stack import (
    DATATYPES,
    assert_round_trip,
    build_repository,
    grpc_url,
    protocol_stack,
    sample,
)


@pytest.fixture(scope="module", params=["native", "grpcio"])
def stack(request: pytest.FixtureRequest, redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Each test against both gRPC listeners (CONVEYOR_GRPC_SERVER)."""
    yield from protocol_stack(redis_server, logdir,
                              build_repository(tmp_path_factory.mktemp("grpc-repo")),
                              CONVEYOR_GRPC_SERVER=request.param)


def alltypes_inputs(arrays: dict[str, np.ndarray], module: ModuleType = grpcclient
                    ) -> list[grpcclient.InferInput]:
    inputs = []
    for datatype, array in arrays.items():
        item = module.InferInput(f"IN_{datatype}", list(array.shape), datatype)
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


def results(result: grpcclient.InferResult) -> dict[str, np.ndarray]:
    return {d: result.as_numpy(f"OUT_{d}") for d in DATATYPES}


def test_every_datatype_round_trips(stack: Stack) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(stack))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("alltypes")
    arrays = sample(rows=2, cols=3, seed=4)
    result = client.infer("alltypes", alltypes_inputs(arrays), request_id="g-1",
                          priority=1, timeout=10_000_000)
    assert result.get_response().id == "g-1"
    assert_round_trip(arrays, results(result))
    some = client.infer("alltypes", alltypes_inputs(arrays),
                        outputs=[grpcclient.InferRequestedOutput("OUT_BYTES")],
                        compression_algorithm="gzip")
    assert [o.name for o in some.get_response().outputs] == ["OUT_BYTES"]
    assert list(some.as_numpy("OUT_BYTES").ravel()) == list(arrays["BYTES"].ravel())
    client.close()


def test_async_client_concurrent_requests(stack: Stack) -> None:
    async def run() -> list[grpcclient.InferResult]:
        client = aiogrpcclient.InferenceServerClient(grpc_url(stack))
        try:
            assert await client.is_model_ready("alltypes")
            calls = [client.infer("alltypes", alltypes_inputs(sample(1, 2, seed), aiogrpcclient))
                     for seed in range(12)]
            return list(await asyncio.gather(*calls))
        finally:
            await client.close()

    for seed, result in enumerate(asyncio.run(run())):
        assert_round_trip(sample(1, 2, seed), results(result))


StreamAnswer = tuple[grpcclient.InferResult | None, InferenceServerException | None]
"""What a stream's callback gets: a result, or (result None) an error."""


def test_stream_answers_every_request_and_reports_errors_in_band(stack: Stack) -> None:
    answers: queue.Queue[StreamAnswer] = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url(stack))
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
    for i in range(6):
        item = grpcclient.InferInput("x", [1, 4], "FP32")
        item.set_data_from_numpy(np.full((1, 4), i, np.float32))
        client.async_stream_infer("echo", [item], request_id=f"s-{i}")
    bad = grpcclient.InferInput("x", [1, 5], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 5), np.float32))
    client.async_stream_infer("echo", [bad], request_id="s-bad")
    got, errors = {}, []
    for _ in range(7):
        result, error = answers.get(timeout=30)
        if error is not None:
            errors.append(error)
        else:
            assert result is not None
            got[result.get_response().id] = result.as_numpy("y")
    client.stop_stream()
    client.close()
    assert sorted(got) == [f"s-{i}" for i in range(6)]
    for i in range(6):
        np.testing.assert_array_equal(got[f"s-{i}"], np.full((1, 4), 2.0 * i))
    assert len(errors) == 1 and "Expected [-1,4], got [1,5]" in errors[0].message()


def test_onnx_model_without_config_matches_onnxruntime(stack: Stack) -> None:
    x = np.random.default_rng(5).normal(size=(4, 4)).astype(np.float32)
    session = ort.InferenceSession(str(stack.repository / "onnx_mlp" / "model.onnx"))
    want_y, want_c = session.run(["Y", "C"], {"X": x})
    client = grpcclient.InferenceServerClient(grpc_url(stack))
    item = grpcclient.InferInput("X", [4, 4], "FP32")
    item.set_data_from_numpy(x)
    result = client.infer("onnx_mlp", [item])
    np.testing.assert_allclose(result.as_numpy("Y"), want_y, rtol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("C"), want_c)
    config = client.get_model_config("onnx_mlp", as_json=True)["config"]
    assert config["backend"] == "onnxruntime" and config["platform"] == "onnxruntime_onnx"
    assert config["input"][0]["dims"] == ["4"]  # MessageToJson renders int64 as strings
    meta = client.get_model_metadata("onnx_mlp")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        ("Y", "FP32", [-1, 3]), ("C", "INT64", [-1])]
    client.close()


def test_config_statistics_and_index(stack: Stack) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(stack))
    config = client.get_model_config("echo").config
    assert config.name == "echo" and config.max_batch_size == 32
    assert config.dynamic_batching.default_queue_policy.default_timeout_microseconds == 30_000_000
    assert config.instance_group[0].count == 1
    item = grpcclient.InferInput("x", [2, 4], "FP32")
    item.set_data_from_numpy(np.ones((2, 4), np.float32))
    client.infer("echo", [item])

    def echo_stats() -> Any:
        return client.get_inference_statistics("echo").model_stats[0]

    # Workers flush their counters every 0.1 s, so the last batch shows up a little later.
    wait_for(lambda: echo_stats().inference_count >= 2, 5, "the batch in the statistics")
    stats = echo_stats()
    assert stats.name == "echo"
    assert stats.inference_stats.success.count >= 1 and stats.inference_stats.queue.ns > 0
    assert any(b.batch_size >= 2 for b in stats.batch_stats)
    assert len(client.get_inference_statistics().model_stats) == 4
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    assert index == dict.fromkeys(["alltypes", "echo", "onnx_mlp", "slow"], "READY")
    assert client.get_server_metadata().name == "conveyor"
    client.close()


def test_errors_map_to_status_codes(stack: Stack) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(stack))
    item = grpcclient.InferInput("x", [1, 4], "FP32")
    item.set_data_from_numpy(np.ones((1, 4), np.float32))
    wrong_type = grpcclient.InferInput("x", [1, 4], "INT32")
    wrong_type.set_data_from_numpy(np.ones((1, 4), np.int32))
    cases: list[tuple[Callable[[], object], str, str]] = [
        (lambda: client.infer("missing", [item]), "NOT_FOUND",
         "Request for unknown model: 'missing' is not found"),
        (lambda: client.infer("echo", [item], model_version="3"), "NOT_FOUND",
         "Request for unknown model: 'echo' version 3 is not found"),
        (lambda: client.get_model_metadata("missing"), "NOT_FOUND", "unknown model"),
        (lambda: client.get_model_config("missing"), "NOT_FOUND", "unknown model"),
        (lambda: client.get_inference_statistics("missing"), "NOT_FOUND", "unknown model"),
        (lambda: client.infer("echo", [wrong_type]), "INVALID_ARGUMENT",
         "inference input 'x' data-type is 'INT32', but model 'echo' expects 'FP32'"),
        (lambda: client.infer("echo", [item], priority=99), "INVALID_ARGUMENT", "priority"),
        (lambda: client.infer("slow", [item], timeout=1), "DEADLINE_EXCEEDED", "deadline"),
        (lambda: client.infer("echo", [item], outputs=[
            grpcclient.InferRequestedOutput("y", class_count=2)]), "INVALID_ARGUMENT",
         "classification"),
        (lambda: client.load_model("echo", config='{"sequence_batching": {}}'),
         "INVALID_ARGUMENT", "sequence batching (stateful models) is not supported"),
        (lambda: client.unload_model("missing"), "NOT_FOUND", "unknown model"),
    ]
    for call, status, text in cases:
        with pytest.raises(InferenceServerException) as caught:
            call()
        assert caught.value.status() == f"StatusCode.{status}", caught.value
        assert text in caught.value.message()
    assert not client.is_model_ready("missing")
    client.close()


def test_contents_next_to_raw_input_contents_are_refused(stack: Stack) -> None:
    """Triton's grpc_explicit_int_content_client: typed contents alone answer; contents on an
    input of a request carrying raw_input_contents are refused, before the entries count."""
    request = service_pb2.ModelInferRequest(model_name="echo")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents[:] = [1.0, 2.0, 3.0, 4.0]
    with grpc.insecure_channel(grpc_url(stack)) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelInfer(request, timeout=30)
        np.testing.assert_array_equal(np.frombuffer(answer.raw_output_contents[0], np.float32),
                                      [2.0, 4.0, 6.0, 8.0])  # echo doubles
        for _ in range(2):  # one entry per input, then one too many
            request.raw_input_contents.append(np.ones(4, np.float32).tobytes())
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(request, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == ("contents field must not be specified when using "
                                               "raw_input_contents for 'x' for model 'echo'")


def test_standard_health_service_and_metrics(stack: Stack) -> None:
    with grpc.insecure_channel(grpc_url(stack)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    client = grpcclient.InferenceServerClient(grpc_url(stack))
    item = grpcclient.InferInput("x", [1, 4], "FP32")
    item.set_data_from_numpy(np.ones((1, 4), np.float32))
    client.infer("echo", [item])
    client.close()
    text = httpx.get(f"{stack.url}/metrics").text
    assert re.search(r'conveyor_protocol_requests_total\{protocol="grpc"\} [1-9]', text)


def test_without_workers_grpc_answers_unavailable_and_health_not_serving(make_stack: MakeStack) -> None:
    stack = make_stack(CONVEYOR_GRPC_PORT=str(free_port()), CONVEYOR_MODELS="echo")
    stack.add_api()
    client = grpcclient.InferenceServerClient(grpc_url(stack))
    assert client.is_server_live() and not client.is_server_ready()
    item = grpcclient.InferInput("x", [1, 4], "FP32")
    item.set_data_from_numpy(np.ones((1, 4), np.float32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("echo", [item])
    assert caught.value.status() == "StatusCode.UNAVAILABLE"
    assert "no worker" in caught.value.message()
    client.close()
    with grpc.insecure_channel(grpc_url(stack)) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
