"""The HTTP API in-process (create_app over the in-memory dispatcher): request parsing,
unknown models and methods, metadata, health, the infer path up to the dispatcher, and
body limits as the settings set them. What needs real workers is in tests/test_infer.py."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api import service as service_module
from api.main import create_app
from batching.envelope import Request
from batching.settings import Settings
from tests.unit.conftest import serve, unit_settings
from tests.unit.memory_dispatch import MemoryDispatcher


def body(values: np.ndarray, **extra: object) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(values.shape),
                        "data": values.ravel().tolist()}], **extra}


@pytest.mark.parametrize("payload,status,message", [
    ({"inputs": [{"name": "z", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}]},
     400, "unexpected inference input 'z' for model 'echo'"),
    ({"inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 4], "data": [0] * 4}]},
     400, "inference input 'x' data-type is 'INT32', but model 'echo' expects 'FP32'"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4], "data": [0] * 4}]},
     400, "unexpected shape for input 'x' for model 'echo'. Expected [-1,4], got [4]"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 5], "data": [0] * 5}]},
     400, "unexpected shape for input 'x' for model 'echo'. Expected [-1,4], got [1,5]"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0] * 3}]},
     400, "Failed to parse 'data' field: shape does not match true shape"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": ["a"] * 4}]},
     400, "input 'x': data is not FP32"),
    ({"inputs": []}, 400, "non-empty list"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}],
      "outputs": [{"name": "nope"}]}, 400, "unexpected inference output 'nope' for model 'echo'"),
])
def test_bad_input_gets_a_precise_400(client: TestClient, dispatcher: MemoryDispatcher,
                                      payload: dict[str, Any], status: int, message: str) -> None:
    response = client.post("/v2/models/echo/infer", json=payload)
    assert response.status_code == status
    assert message in response.json()["error"]
    assert dispatcher.submitted == []


def test_malformed_json_is_400(client: TestClient) -> None:
    response = client.post("/v2/models/echo/infer", content=b"{nope")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]


def test_unknown_model_is_404(client: TestClient) -> None:
    response = client.post("/v2/models/missing/infer", json=body(np.ones((1, 4), np.float32)))
    assert response.status_code == 404
    assert response.json() == {"error": "Request for unknown model: 'missing' is not found"}
    assert client.get("/v2/models/missing").status_code == 404
    assert client.post("/v2/models/echo/versions/2/infer", json={}).status_code == 404


@pytest.mark.parametrize("method,path", [
    ("POST", "/v2"), ("DELETE", "/v2/health/live"), ("GET", "/v2/repository/index"),
    ("PUT", "/v2/models/echo"), ("GET", "/v2/repository/models/echo/load"),
])
def test_a_wrong_method_is_405_with_an_error_body(client: TestClient, method: str,
                                                 path: str) -> None:
    response = client.request(method, path)
    assert response.status_code == 405
    assert response.json() == {"error": "Method Not Allowed"}


def test_metadata_describes_the_signature(client: TestClient) -> None:
    meta = client.get("/v2/models/echo").json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert client.get("/v2/models/echo/versions/1").json() == meta
    assert client.get("/v2").json()["name"] == "conveyor"
    config = client.get("/v2/models/echo/config").json()
    assert config["name"] == "echo" and config["max_batch_size"] == 32


def test_health_follows_the_heartbeats(client: TestClient, dispatcher: MemoryDispatcher) -> None:
    """echo has a ready worker, slow none: live, echo ready, the server not ready (slow
    neither ready nor failed), until slow's worker beats too."""
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/models/echo/ready").json() == {"name": "echo", "ready": True}
    slow = client.get("/v2/models/slow/ready")
    assert slow.status_code == 503 and "has no ready worker" in slow.json()["error"]
    assert client.get("/v2/health/ready").status_code == 503


def test_the_server_is_ready_when_every_model_has_a_ready_worker(
        settings: Settings, dispatcher: MemoryDispatcher) -> None:
    dispatcher.beat("echo")
    dispatcher.beat("slow")
    with serve(settings, dispatcher) as client:
        assert client.get("/v2/health/ready").json() == {"ready": True}


def test_a_request_reaches_the_dispatcher_and_its_reply_is_rendered(
        client: TestClient, dispatcher: MemoryDispatcher) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    response = client.post("/v2/models/echo/infer", json=body(x, id="req-1"))
    assert response.status_code == 200, response.text
    assert response.json()["id"] == "req-1"
    y = next(o for o in response.json()["outputs"] if o["name"] == "y")
    np.testing.assert_array_equal(np.array(y["data"]).reshape(y["shape"]), x * 2)
    [(admission, request)] = dispatcher.submitted
    assert (admission.stream, admission.rows, admission.max_rows) == ("unit:{echo}:q:2", 2, 10000)
    assert request.reply == dispatcher.reply_key


def test_the_enqueue_time_keeps_its_microseconds(
        client: TestClient, dispatcher: MemoryDispatcher, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's queue_ms counts from it: truncated to the ms, every queue time in
    conveyor_queue_duration_seconds read half a ms long on average."""
    clock = SimpleNamespace(time=lambda: 1_700_000_000.0009, perf_counter=time.perf_counter)
    monkeypatch.setattr(service_module, "time", clock)
    assert client.post("/v2/models/echo/infer",
                       json=body(np.ones((1, 4), np.float32))).status_code == 200
    [(_, request)] = dispatcher.submitted
    assert request.enq_ms == pytest.approx(1_700_000_000_000.9, abs=1e-3)
    back = Request.decode(request.encode())
    assert back.enq_ms == request.enq_ms
    # The default timeout, 30 s, from when the request was read: the time from the read to
    # the clock read above comes off it (a few ms on a busy host).
    assert 1_700_000_000_000 + 29_000 <= back.deadline_ms <= 1_700_000_000_000 + 30_000


def test_only_the_requested_outputs_are_rendered(client: TestClient,
                                                dispatcher: MemoryDispatcher) -> None:
    response = client.post("/v2/models/echo/infer", json=body(np.ones((1, 4), np.float32),
                                                              outputs=[{"name": "batch_rows"}]))
    assert [o["name"] for o in response.json()["outputs"]] == ["batch_rows"]
    assert dispatcher.submitted[0][1].outputs == ["batch_rows"]


def test_metrics_count_outcomes_and_batch_sizes(client: TestClient) -> None:
    assert client.post("/v2/models/echo/infer",
                       json=body(np.ones((1, 4), np.float32))).status_code == 200
    assert client.post("/v2/models/echo/infer", json={"inputs": []}).status_code == 400
    text = client.get("/metrics").text
    assert 'conveyor_requests_total{model="echo",outcome="success"} 1.0' in text
    assert 'conveyor_requests_total{model="echo",outcome="invalid_input"} 1.0' in text
    assert 'conveyor_protocol_requests_total{protocol="http_json"} 2.0' in text
    assert "conveyor_request_duration_seconds_bucket" in text
    assert 'conveyor_queue_duration_seconds_bucket{le="0.005",model="echo"} 1.0' in text
    assert 'conveyor_request_batch_size_bucket{le="1.0",model="echo"} 1.0' in text


def test_a_model_without_any_worker_is_503_before_the_dispatcher(
        client: TestClient, dispatcher: MemoryDispatcher) -> None:
    response = client.post("/v2/models/slow/infer", json=body(np.ones((1, 4), np.float32)))
    assert response.status_code == 503
    assert response.json() == {"error": "model 'slow' has no worker"}
    assert dispatcher.submitted == []


def test_a_body_over_the_configured_limit_is_413(dispatcher: MemoryDispatcher) -> None:
    dispatcher.beat("echo")
    with serve(unit_settings(max_request_bytes=1024), dispatcher) as client:
        small = client.post("/v2/models/echo/infer", json=body(np.ones((1, 4), np.float32)))
        large = client.post("/v2/models/echo/infer", json=body(np.ones((64, 4), np.float32)))
    assert small.status_code == 200
    assert large.status_code == 413 and "1024" in large.json()["error"]


def test_the_app_builds_and_serves_without_the_grpc_modules(client: TestClient) -> None:
    """create_app(grpc=False) never imports api.proto, whose protobuf symbols would collide
    with tritonclient's in a test process."""
    assert client.get("/v2").status_code == 200
    assert not [m for m in sys.modules if m.startswith(("api.proto", "api.grpc_server"))]


def test_importing_the_module_builds_no_application() -> None:
    """uvicorn --factory and the tests call create_app; nothing is built at import."""
    import api.main

    assert callable(api.main.create_app) and not hasattr(api.main, "app")


def test_an_unexpected_error_is_500_with_an_error_body(settings: Settings,
                                                        dispatcher: MemoryDispatcher,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug answers ``{"error": ...}`` like every other error (tritonclient decodes it),
    naming only the exception's type."""
    async def broken(*_: object) -> None:
        raise RuntimeError("/secret/path")

    monkeypatch.setattr("api.routes.statistics", broken)
    with TestClient(create_app(settings, dispatcher, grpc=False),
                    raise_server_exceptions=False) as client:
        response = client.get("/v2/models/stats")
    assert response.status_code == 500
    assert response.json() == {"error": "internal error: RuntimeError"}


def test_the_server_name_is_a_setting(dispatcher: MemoryDispatcher) -> None:
    with serve(unit_settings(server_name="triton"), dispatcher) as client:
        assert client.get("/v2").json()["name"] == "triton"


@pytest.mark.parametrize("ready", ["yes", 1, [True], None])
def test_repository_index_wants_a_boolean_ready(client: TestClient, ready: object) -> None:
    response = client.post("/v2/repository/index", json={"ready": ready})
    assert response.status_code == 400
    assert response.json() == {"error": "Invalid value for 'ready': expected a boolean"}
