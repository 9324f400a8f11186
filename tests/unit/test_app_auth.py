"""API keys over the whole application in-process: the guard wraps the infer hot path,
the FastAPI routes and the docs assets alike (docs/security.md, "Authentication")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.unit.conftest import serve, unit_settings
from tests.unit.memory_dispatch import MemoryDispatcher

KEYS = "inf-key infer\njob-key jobs\nadm-key admin\n"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keyed(tmp_path: Path, dispatcher: MemoryDispatcher) -> Iterator[TestClient]:
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    dispatcher.beat("echo")
    with serve(unit_settings(api_keys_file=keys), dispatcher) as client:
        yield client


@pytest.mark.parametrize("method,path", [
    ("GET", "/v2"), ("POST", "/v2/models/echo/infer"), ("POST", "/v2/repository/models/echo/unload"),
    ("GET", "/v1/jobs"), ("GET", "/docs"), ("GET", "/docs/assets/swagger-ui.css"),
    ("GET", "/openapi.json"), ("GET", "/v2/nothing/here"),
])
def test_without_a_key_every_path_but_health_is_401(keyed: TestClient, dispatcher: MemoryDispatcher,
                                                    method: str, path: str) -> None:
    response = keyed.request(method, path, content=b"{}")
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert "error" in response.json()
    assert dispatcher.submitted == []


def test_keys_reach_what_their_scopes_cover(keyed: TestClient) -> None:
    infer = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}
    assert keyed.get("/v2/health/live").status_code == 200
    assert keyed.get("/metrics").status_code == 200
    assert keyed.post("/v2/models/echo/infer", json=infer, headers=bearer("inf-key")).status_code == 200
    assert keyed.get("/docs", headers=bearer("inf-key")).status_code == 200
    assert keyed.get("/docs/assets/swagger-ui.css", headers=bearer("job-key")).status_code == 200
    assert keyed.get("/v2/models/echo", headers=bearer("adm-key")).status_code == 200
    denied = keyed.post("/v2/models/echo/infer", json=infer, headers=bearer("job-key"))
    assert denied.status_code == 403
    assert denied.headers["www-authenticate"] == 'Bearer error="insufficient_scope"'
    assert keyed.post("/v2/repository/models/echo/unload",
                      headers=bearer("inf-key")).status_code == 403
