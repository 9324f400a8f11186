"""A Triton-layout repository served unchanged, driven with tritonclient over HTTP and gRPC:
config.pbtxt, version folders and policy, max_batch_size 0, a TritonPythonModel, models
whose files say more than their config, unsupported features, load with a config override."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeAlias

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Stack
from tests.procs import RedisServer
from tests.protocol_stack import grpc_url, http_host, protocol_stack
from tests.triton_layout import build_triton_repository

Client: TypeAlias = httpclient.InferenceServerClient | grpcclient.InferenceServerClient
ROWS = np.arange(8, dtype=np.float32).reshape(2, 4)


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from protocol_stack(redis_server, logdir,
                              build_triton_repository(tmp_path_factory.mktemp("triton-repo")))


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, stack: Stack) -> Iterator[Client]:
    if request.param == "http":
        with httpclient.InferenceServerClient(http_host(stack), network_timeout=150) as made:
            yield made
    else:
        with grpcclient.InferenceServerClient(grpc_url(stack)) as made:
            yield made


def module(client: Client) -> Any:
    return httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient


def infer(client: Client, model: str, array: np.ndarray, version: str = "",
          name: str = "INPUT0") -> Any:
    item = module(client).InferInput(name, list(array.shape), "FP32")
    item.set_data_from_numpy(array)
    return client.infer(model, [item], model_version=version)


def as_dict(client: Client, value: Any) -> dict[str, Any]:
    """A gRPC answer as the JSON the HTTP client returns."""
    if isinstance(client, grpcclient.InferenceServerClient):
        from google.protobuf.json_format import MessageToDict

        return dict(MessageToDict(value, preserving_proto_field_name=True))
    return dict(value)


def index(stack: Stack) -> list[dict[str, Any]]:
    response = httpx.post(f"{stack.url}/v2/repository/index", content=b"")
    assert response.status_code == 200, response.text
    return list(response.json())


def test_the_index_lists_each_served_version_and_why_a_model_is_unavailable(
        stack: Stack) -> None:
    entries = {(e["name"], e["version"]): e for e in index(stack)}
    ready = {key for key, e in entries.items() if e["state"] == "READY"}
    assert ready == {("scale", "2"), ("scale", "3"), ("reverse", "1"), ("scalar", "1"),
                     ("fixed", "1")}
    assert "sequence batching (stateful models) is not supported" in entries[
        ("stateful", "1")]["reason"]
    assert "config.pbtxt line 4" in entries[("stateful", "1")]["reason"]
    unsigned = entries[("unsigned", "1")]
    assert unsigned["state"] == "UNAVAILABLE"
    assert "needs its inputs and outputs declared" in unsigned["reason"]


def test_metadata_and_config_come_from_config_pbtxt(client: Client) -> None:
    meta = as_dict(client, client.get_model_metadata("scale"))
    assert meta["versions"] == ["2", "3"]
    (given,) = meta["inputs"]
    assert (given["name"], given["datatype"], [int(d) for d in given["shape"]]) == (
        "INPUT0", "FP32", [-1, 4])
    config = as_dict(client, client.get_model_config("scale"))
    config = config.get("config", config)
    assert int(config["max_batch_size"]) == 8
    assert [int(d) for d in config["input"][0]["dims"]] == [4]
    assert int(config["version_policy"]["latest"]["num_versions"]) == 2
    batching = config["dynamic_batching"]
    assert [int(p) for p in batching["preferred_batch_size"]] == [4, 8]
    assert int(batching["priority_levels"]) == 2
    assert int(batching["default_queue_policy"]["max_queue_size"]) == 100
    assert as_dict(client, client.get_model_metadata("scale", "2"))["name"] == "scale"
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("scale", "1")
    assert "Request for unknown model: 'scale' version 1 is not found" in caught.value.message()


def test_each_served_version_answers_with_its_own_graph(client: Client) -> None:
    for version, factor in (("2", 2.0), ("3", 3.0), ("", 3.0)):
        result = infer(client, "scale", ROWS, version)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), ROWS * factor)
        assert as_dict(client, result.get_response())["model_version"] == (version or "3")
    assert client.is_model_ready("scale", "2") and client.is_model_ready("scale", "3")
    assert client.is_model_ready("scale", "02")  # a version is a number, on both protocols
    assert not client.is_model_ready("scale", "1") and not client.is_model_ready("scale", "x")
    with pytest.raises(InferenceServerException) as caught:
        infer(client, "scale", ROWS, "1")
    assert "Request for unknown model: 'scale' version 1 is not found" in caught.value.message()


def concurrently(stack: Stack, model: str, arrays: list[np.ndarray],
                 versions: list[str]) -> list[np.ndarray]:
    """Every request in flight at once (tritonclient's HTTP async_infer)."""
    with httpclient.InferenceServerClient(http_host(stack), concurrency=16) as http:
        pending = []
        for array, version in zip(arrays, versions, strict=True):
            item = httpclient.InferInput("INPUT0", list(array.shape), "FP32")
            item.set_data_from_numpy(array)
            pending.append(http.async_infer(model, [item], model_version=version))
        return [p.get_result().as_numpy("OUTPUT0") for p in pending]


def test_versions_batch_apart_under_concurrency(stack: Stack) -> None:
    arrays = [ROWS + i for i in range(64)]
    versions = ["2" if i % 2 else "3" for i in range(64)]
    for got, array, version in zip(concurrently(stack, "scale", arrays, versions), arrays,
                                   versions, strict=True):
        np.testing.assert_array_equal(got, array * float(version))


def test_a_model_without_a_batch_dim_runs_each_request_with_its_shapes(client: Client) -> None:
    given = np.array([1.0, 2.0, 4.0], np.float32)
    result = infer(client, "reverse", given)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [4.5, 2.5, 1.5])
    np.testing.assert_array_equal(result.as_numpy("SIZE"), [3])
    config = as_dict(client, client.get_model_config("reverse"))
    config = config.get("config", config)
    assert int(config.get("max_batch_size", 0)) == 0
    assert [int(d) for d in config["input"][0]["dims"]] == [3]
    with pytest.raises(InferenceServerException) as caught:
        infer(client, "reverse", given.reshape(1, 3))
    assert "Expected [3], got [1,3]" in caught.value.message()


def test_reshape_hands_the_model_its_own_shape(client: Client) -> None:
    given = np.array([[1.0], [2.0], [3.0]], np.float32)
    np.testing.assert_array_equal(infer(client, "scalar", given).as_numpy("OUTPUT0"),
                                  given * 10)
    config = as_dict(client, client.get_model_config("scalar"))
    config = config.get("config", config)
    assert config["input"][0]["reshape"] in ({"shape": []}, {})  # JSON drops an empty list
    assert [int(d) for d in config["input"][0]["dims"]] == [1]


def test_a_graph_with_a_fixed_first_dim_is_served_without_batching(stack: Stack) -> None:
    with httpclient.InferenceServerClient(http_host(stack)) as http:
        assert http.get_model_metadata("fixed")["inputs"][0]["shape"] == [1, 4]
        assert http.get_model_config("fixed")["max_batch_size"] == 0
    rows = [np.full((1, 4), float(i), np.float32) for i in range(32)]
    for got, row in zip(concurrently(stack, "fixed", rows, [""] * 32), rows, strict=True):
        np.testing.assert_array_equal(got, row)


def test_load_with_a_config_override_changes_the_served_versions(stack: Stack) -> None:
    http = httpclient.InferenceServerClient(http_host(stack), network_timeout=150)
    grpc = grpcclient.InferenceServerClient(grpc_url(stack))
    try:
        config = http.get_model_config("scale")
        config["version_policy"] = {"specific": {"versions": ["1", "3"]}}
        grpc.load_model("scale", config=json.dumps(config))
        assert http.get_model_metadata("scale")["versions"] == ["1", "3"]
        np.testing.assert_array_equal(infer(http, "scale", ROWS, "1").as_numpy("OUTPUT0"), ROWS)
        np.testing.assert_array_equal(infer(grpc, "scale", ROWS, "3").as_numpy("OUTPUT0"),
                                      ROWS * 3)
        with pytest.raises(InferenceServerException):
            infer(http, "scale", ROWS, "2")

        bad = {**config, "sequence_batching": {}}
        for client in (http, grpc):
            with pytest.raises(InferenceServerException) as caught:
                client.load_model("scale", config=json.dumps(bad))
            assert "sequence batching (stateful models) is not supported" in (
                caught.value.message())
        assert http.get_model_metadata("scale")["versions"] == ["1", "3"], "unchanged"

        http.load_model("scale")  # the folder's config.pbtxt again
        assert http.get_model_metadata("scale")["versions"] == ["2", "3"]
        np.testing.assert_array_equal(infer(grpc, "scale", ROWS, "2").as_numpy("OUTPUT0"),
                                      ROWS * 2)
    finally:
        http.close()
        grpc.close()


def test_model_files_from_a_client_are_refused(stack: Stack) -> None:
    http = httpx.post(f"{stack.url}/v2/repository/models/scale/load",
                      json={"parameters": {"config": "{}", "file:1/model.onnx": "AAAA"}})
    assert http.status_code == 500  # as Triton: its model-control examples check it
    assert "failed to poll from model repository" in http.json()["error"]
    assert "never from a client" in http.json()["error"]
    with grpcclient.InferenceServerClient(grpc_url(stack)) as grpc:
        with pytest.raises(InferenceServerException) as caught:
            grpc.load_model("scale", config="{}", files={"file:1/model.onnx": b"\0"})
        assert caught.value.status() == "StatusCode.INTERNAL"
        assert "failed to poll from model repository" in caught.value.message()
        assert "never from a client" in caught.value.message()
