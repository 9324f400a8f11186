"""Model versions and a model without a batch dim, through the API in this process: what a
request carries to the worker, the version that answers, and what is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from batching.envelope import VERSION, WHOLE, Reply, Request
from batching.keys import Keys
from tests.unit.conftest import serve, unit_settings
from tests.unit.memory_dispatch import MemoryDispatcher

CONFIG = """\
backend: "python"
max_batch_size: 0
version_policy { all { } }
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
"""


@pytest.fixture
def seen() -> list[Request]:
    return []


@pytest.fixture
def client(tmp_path: Path, seen: list[Request]) -> Iterator[TestClient]:
    folder = tmp_path / "v"
    for version in ("1", "2"):
        (folder / version).mkdir(parents=True)
        (folder / version / "model.py").write_text("")
    (folder / "config.pbtxt").write_text(CONFIG)
    settings = unit_settings(model_repository=tmp_path, models="v")

    def answer(request: Request) -> Reply:
        seen.append(request)
        return Reply(request.id, request.inputs, batch_rows=1)

    dispatcher = MemoryDispatcher(Keys(settings.key_prefix), answer)
    dispatcher.beat("v")
    with serve(settings, dispatcher) as made:
        yield made


def body(shape: list[int]) -> dict[str, object]:
    count = 1
    for dim in shape:
        count *= dim
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": shape,
                        "data": [1.0] * count}]}


def test_a_request_carries_its_version_and_counts_one_row(client: TestClient,
                                                          seen: list[Request]) -> None:
    assert client.get("/v2/models/v").json()["versions"] == ["1", "2"]
    for path, version in (("/v2/models/v/versions/1/infer", "1"), ("/v2/models/v/infer", "2")):
        response = client.post(path, json=body([3]))
        assert response.status_code == 200, response.text
        assert response.json()["model_version"] == version
        assert seen[-1].params[VERSION] == version and seen[-1].params[WHOLE] == 1
        assert seen[-1].rows == 1
    assert client.get("/v2/models/v/versions/1/ready").status_code == 200


def test_a_version_not_served_and_a_batch_dim_are_refused(client: TestClient) -> None:
    for path in ("/v2/models/v/versions/3/infer", "/v2/models/v/versions/3/config"):
        response = client.request("POST" if path.endswith("infer") else "GET", path,
                                  json=body([3]))
        assert response.status_code == 404
        assert response.json() == {
            "error": "Request for unknown model: 'v' version 3 is not found"}
    response = client.post("/v2/models/v/infer", json=body([1, 3]))
    assert response.status_code == 400
    assert "Expected [3], got [1,3]" in response.json()["error"]
    job = client.post("/v1/jobs", json={"model": "v", **body([3])})
    assert job.status_code == 400 and "has no batch dim" in job.json()["error"]


def test_a_version_is_read_as_a_number(client: TestClient, seen: list[Request]) -> None:
    response = client.post("/v2/models/v/versions/01/infer", json=body([3]))
    assert response.status_code == 200, response.text
    assert response.json()["model_version"] == "1" and seen[-1].params[VERSION] == "1"
    response = client.post("/v2/models/v/versions/x/infer", json=body([3]))
    assert response.status_code == 400
    assert "failed to get model version from specified version string 'x'" in \
        response.json()["error"]
