"""System shared memory over HTTP in-process: the routes, inference by region through the
echo model, the hostile registrations, the switch and the scope (docs/protocol.md,
"Shared memory"). tritonclient against real API processes: tests/test_protocol_shm.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.auth import Need
from api.auth_grpc import grpc_need
from tests.unit.conftest import serve, unit_settings
from tests.unit.memory_dispatch import MemoryDispatcher
from tests.unit.shm_objects import Objects, made_objects


@pytest.fixture
def objects() -> Iterator[Objects]:
    yield from made_objects()


BASE = "/v2/systemsharedmemory"


@pytest.fixture
def shm_client(dispatcher: MemoryDispatcher) -> Iterator[TestClient]:
    dispatcher.beat("echo")
    with serve(unit_settings(allow_client_shm=True, shm_max_regions=3), dispatcher) as client:
        yield client


def register(client: TestClient, name: str, key: str, byte_size: int,
             offset: int = 0) -> Any:
    return client.post(f"{BASE}/region/{name}/register",
                       json={"key": key, "offset": offset, "byte_size": byte_size})


def shm_body(x_ref: dict[str, int | str], y_ref: dict[str, int | str]) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                        "parameters": x_ref}],
            "outputs": [{"name": "y", "parameters": y_ref}, {"name": "batch_rows"}]}


def ref(region: str, byte_size: int, offset: int = 0) -> dict[str, int | str]:
    return {"shared_memory_region": region, "shared_memory_byte_size": byte_size,
            "shared_memory_offset": offset}


def test_register_status_unregister(shm_client: TestClient, objects: Objects) -> None:
    key = objects.make(64)
    assert register(shm_client, "in", key, 32, offset=16).status_code == 200
    expected = {"name": "in", "key": key, "offset": 16, "byte_size": 32}
    assert shm_client.get(f"{BASE}/status").json() == [expected]
    assert shm_client.get(f"{BASE}/region/in/status").json() == [expected]
    again = register(shm_client, "in", key, 32)
    assert again.status_code == 400
    assert again.json() == {"error": "shared memory region 'in' already in manager"}
    assert shm_client.post(f"{BASE}/region/in/unregister").status_code == 200
    assert shm_client.get(f"{BASE}/status").json() == []
    missing = shm_client.get(f"{BASE}/region/in/status")
    assert missing.status_code == 404
    assert missing.json() == {"error": "Unable to find system shared memory region: 'in'"}
    assert shm_client.post(f"{BASE}/region/never/unregister").status_code == 200  # as Triton


def test_unregister_without_a_name_drops_every_region(shm_client: TestClient,
                                                      objects: Objects) -> None:
    for name in ("a", "b"):
        assert register(shm_client, name, objects.make(8), 8).status_code == 200
    assert shm_client.post(f"{BASE}/unregister").status_code == 200
    assert shm_client.get(f"{BASE}/status").json() == []


def test_infer_reads_inputs_from_and_writes_outputs_to_regions(
        shm_client: TestClient, dispatcher: MemoryDispatcher, objects: Objects) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    in_key, out_key = objects.make(128, b"\xff" * 8 + x.tobytes()), objects.make(64)
    assert register(shm_client, "in", in_key, 120, offset=8).status_code == 200
    assert register(shm_client, "out", out_key, 64).status_code == 200
    response = shm_client.post("/v2/models/echo/infer",
                               json=shm_body(ref("in", 32), ref("out", 32, offset=16)))
    assert response.status_code == 200, response.text
    y, rows = response.json()["outputs"]
    assert y == {"name": "y", "datatype": "FP32", "shape": [2, 4]}  # no data: it is in the region
    assert rows["data"] == [2, 2]
    written = objects.path(out_key).read_bytes()
    np.testing.assert_array_equal(np.frombuffer(written[16:48], np.float32).reshape(2, 4), x * 2)
    assert written[:16] == written[48:] == b"\0" * 16
    np.testing.assert_array_equal(dispatcher.submitted[0][1].inputs[0].array(), x)


@pytest.mark.parametrize("x_ref,y_ref,status,message", [
    (ref("nope", 32), ref("out", 32), 404, "Unable to find shared memory region: 'nope'"),
    (ref("in", 32), ref("nope", 32), 404, "Unable to find shared memory region: 'nope'"),
    (ref("in", 32, offset=64), ref("out", 32), 400,
     "Invalid offset for shared memory region: 'in'"),
    (ref("in", 32, offset=2**64 - 32), ref("out", 32), 400,
     "Invalid offset for shared memory region: 'in'"),
    (ref("in", 64, offset=1), ref("out", 32), 400,
     "Invalid offset + byte size for shared memory region: 'in'"),
    (ref("in", 32), ref("out", 2**64 - 32, offset=32), 400,
     "Integer overflow detected: byte_size (18446744073709551584) + offset (32) exceeds "
     "maximum value (18446744073709551615) for region 'out'"),
    (ref("in", 36), ref("out", 32), 400,
     "input byte size mismatch for input 'x' for model 'echo'. Expected 32, got 36"),
    (ref("in", 32), ref("out", 16), 400,
     "shared memory size specified with the request for output 'y' (16 bytes) should be at "
     "least 32 bytes to hold the results"),
    ({"shared_memory_region": "in"}, ref("out", 32), 400,
     "'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
     "parameter for tensor 'x'"),
    ({"shared_memory_byte_size": 32}, ref("out", 32), 400,
     "'shared_memory_byte_size' can not be specified without 'shared_memory_region'"),
    (ref("in", -1), ref("out", 32), 400, "invalid value for 'shared_memory_byte_size'"),
    ({**ref("in", 32), "shared_memory_region": 7}, ref("out", 32), 400,
     "invalid value type for 'shared_memory_region' parameter for tensor 'x'"),
    (ref("in", 32), {**ref("out", 32), "binary_data": True}, 400,
     "Output can't set both 'shared_memory_region' and 'binary_data'"),
])
def test_bad_region_references_are_refused(shm_client: TestClient, dispatcher: MemoryDispatcher,
                                           objects: Objects, x_ref: dict[str, Any],
                                           y_ref: dict[str, Any], status: int,
                                           message: str) -> None:
    assert register(shm_client, "in", objects.make(64), 64).status_code == 200
    assert register(shm_client, "out", objects.make(64), 64).status_code == 200
    response = shm_client.post("/v2/models/echo/infer", json=shm_body(x_ref, y_ref))
    assert response.status_code == status, response.text
    assert message in response.json()["error"]


def test_an_input_with_data_and_a_region_is_refused(shm_client: TestClient) -> None:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4,
                        "parameters": ref("in", 16)}]}
    response = shm_client.post("/v2/models/echo/infer", json=body)
    assert response.status_code == 400
    assert response.json()["error"] == (
        "Input must set only one of the following fields: 'data', 'binary_data_size' in "
        "'parameters', 'shared_memory_region' in 'parameters'. But set 'data' "
        "'shared_memory_region'")


@pytest.mark.parametrize("key,message", [
    ("/", "cannot register shared memory region 'r' - invalid shm key '/'"),
    ("///", "invalid shm key '///'"),
    ("/../../etc/passwd", "invalid shm key"),
    ("/a/b", "invalid shm key"),
    ("..", "invalid shm key"),
    ("/" + "k" * 300, "invalid shm key"),
    ("/triton_python_backend_shm_region_x", "cannot register shared memory region 'r' with key "
     "'/triton_python_backend_shm_region_x' as the key contains the reserved prefix "
     "'triton_python_backend_shm_region_'"),
    ("//sem.mp-1", "reserved prefix 'sem.'"),
    ("/conveyor-test-does-not-exist", "Unable to open shared memory region: "
     "'/conveyor-test-does-not-exist'"),
])
def test_hostile_keys_are_refused(shm_client: TestClient, key: str, message: str) -> None:
    response = register(shm_client, "r", key, 8)
    assert response.status_code == 400
    assert message in response.json()["error"]
    assert shm_client.get(f"{BASE}/status").json() == []


def test_keys_that_are_not_plain_objects_are_refused(shm_client: TestClient, objects: Objects,
                                                     tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 64)
    link = objects.path(objects.make(0))
    link.unlink()
    link.symlink_to(secret)  # a link in /dev/shm to a file elsewhere: never followed
    response = register(shm_client, "r", f"/{link.name}", 8)
    assert response.json()["error"] == f"Unable to open shared memory region: '/{link.name}'"
    link.unlink()
    link.mkdir()
    try:
        response = register(shm_client, "r", f"/{link.name}", 8)
        assert response.status_code == 400
        assert "shared memory region" in response.json()["error"]
    finally:
        link.rmdir()


@pytest.mark.parametrize("byte_size,offset", [(65, 0), (64, 1), (1, 64), (0, 65), (0, 0)])
def test_registration_out_of_bounds_is_refused(shm_client: TestClient, objects: Objects,
                                               byte_size: int, offset: int) -> None:
    response = register(shm_client, "r", objects.make(64), byte_size, offset)
    assert response.status_code == 400
    assert response.json() == {"error": "failed to register shared memory region 'r': "
                                        "invalid args"}


@pytest.mark.parametrize("body,message", [
    ({"offset": 0, "byte_size": 8}, "Shared memory register request has no 'key' field"),
    ({"key": "/k"}, "Shared memory register request has no 'byte_size' field"),
    ({"key": 5, "byte_size": 8}, "'key' must be a string"),
    ({"key": "/k", "byte_size": -8}, "'byte_size' must be a non-negative integer"),
    ({"key": "/k", "byte_size": 8, "offset": "1"}, "'offset' must be a non-negative integer"),
])
def test_malformed_register_requests_are_400(shm_client: TestClient, body: dict[str, Any],
                                             message: str) -> None:
    response = shm_client.post(f"{BASE}/region/r/register", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]


def test_registrations_are_bounded(shm_client: TestClient, objects: Objects) -> None:
    for name in ("a", "b", "c"):
        assert register(shm_client, name, objects.make(8), 8).status_code == 200
    response = register(shm_client, "d", objects.make(8), 8)
    assert response.status_code == 400
    assert "3 regions are registered already" in response.json()["error"]
    assert [r["name"] for r in shm_client.get(f"{BASE}/status").json()] == ["a", "b", "c"]


def test_off_by_default(client: TestClient, objects: Objects) -> None:
    response = register(client, "r", objects.make(8), 8)
    assert response.status_code == 501
    assert response.json()["error"].startswith("Client shared memory is disabled.")
    assert client.post(f"{BASE}/unregister").status_code == 501
    assert client.get(f"{BASE}/status").json() == []
    infer = client.post("/v2/models/echo/infer", json=shm_body(ref("r", 32), ref("r", 32)))
    assert infer.status_code == 404
    assert infer.json() == {"error": "Unable to find shared memory region: 'r'"}


def test_cuda_shared_memory_lists_nothing_and_refuses_a_register(client: TestClient) -> None:
    assert client.get("/v2/cudasharedmemory/status").json() == []
    for path in ("/v2/cudasharedmemory/unregister", "/v2/cudasharedmemory/region/r/unregister"):
        assert client.post(path).status_code == 200
    missing = client.get("/v2/cudasharedmemory/region/r/status")
    assert missing.status_code == 404
    assert missing.json() == {"error": "Unable to find cuda shared memory region: 'r'"}
    response = client.post("/v2/cudasharedmemory/region/r/register", content=b"{}")
    assert response.status_code == 501
    assert "CUDA shared memory is not supported" in response.json()["error"]


def test_server_metadata_lists_the_extension(client: TestClient) -> None:
    assert "system_shared_memory" in client.get("/v2").json()["extensions"]


def test_jobs_refuse_region_tensors(shm_client: TestClient) -> None:
    body = {"model": "echo", **shm_body(ref("in", 32), ref("out", 32))}
    response = shm_client.post("/v1/jobs", json=body)
    assert response.status_code == 400
    assert "not supported by jobs" in response.json()["error"]


def test_registering_needs_the_infer_scope(tmp_path: Path, dispatcher: MemoryDispatcher,
                                          objects: Objects) -> None:
    keys = tmp_path / "keys"
    keys.write_text("inf-key infer\njob-key jobs\n")
    key = objects.make(8)
    with serve(unit_settings(api_keys_file=keys, allow_client_shm=True), dispatcher) as client:
        assert register(client, "r", key, 8).status_code == 401
        jobs_only = client.post(f"{BASE}/region/r/register", headers={"Authorization": "job-key"},
                                json={"key": key, "byte_size": 8})
        assert jobs_only.status_code == 403
        assert client.get(f"{BASE}/status", headers={"Authorization": "job-key"}
                          ).status_code == 403
        ok = client.post(f"{BASE}/region/r/register", headers={"Authorization": "inf-key"},
                         json={"key": key, "byte_size": 8})
        assert ok.status_code == 200
    for method in ("SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
                   "SystemSharedMemoryStatus", "CudaSharedMemoryRegister"):
        assert grpc_need(f"/inference.GRPCInferenceService/{method}") is Need.INFER
