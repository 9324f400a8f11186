"""API keys (api.auth), the HTTP guard around the whole app and the gRPC interceptor."""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.auth import Guard, KeyStore, Need, Scope, key_digest, parse_keys
from api.auth_grpc import AuthInterceptor, grpc_need
from api.auth_http import AuthGuard, http_need
from api.main import create_app
from api.proto import inference_pb2 as pb
from api.proto import inference_pb2_grpc as pb_grpc
from batching.errors import PermissionDenied, Unauthenticated
from batching.settings import Settings
from tests.conftest import TEST_MODELS
from tests.procs import free_port

with warnings.catch_warnings():  # Starlette would rather have httpx2; httpx serves
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

KEYS = """
# the team's keys
inf-key   infer
job-key   jobs
both-key  infer,jobs

adm-key   admin
"""


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(KEYS)
    return path


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_file_lines_give_scopes_and_bad_lines_are_skipped_without_their_key(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, "conveyor.auth"):
        table = parse_keys("good infer,jobs\nsecret-one\nsecret-two root\n# c\n\n", "keys")
    assert set(table) == {key_digest("good")}
    assert table[key_digest("good")].scopes == {Scope.INFER, Scope.JOBS}
    assert "line 2" in caplog.text and "line 3" in caplog.text
    assert "secret" not in caplog.text


def test_keys_rotate_when_the_file_changes_looked_at_at_most_once_a_second(
        keys_file: Path) -> None:
    now = [100.0]
    store = KeyStore(keys_file, clock=lambda: now[0])
    assert store.lookup("inf-key") is not None and store.lookup("new-key") is None
    keys_file.write_text("new-key admin\n")
    now[0] += 0.5
    assert store.lookup("inf-key") is not None  # not looked at again yet
    now[0] += 0.6
    assert store.lookup("inf-key") is None
    new = store.lookup("new-key")
    assert new is not None and new.admin and new.digest == key_digest("new-key")
    keys_file.unlink()
    now[0] += 1.1
    assert store.lookup("new-key") is None  # a keys file that vanished lets nobody in


def test_the_guard_checks_scopes_admin_covers_all_and_health_is_open_by_choice(
        keys_file: Path) -> None:
    guard = Guard(KeyStore(keys_file), auth_health=False, auth_metrics=True)
    assert guard.check(Need.HEALTH, None) is None
    with pytest.raises(Unauthenticated):
        guard.check(Need.METRICS, None)
    assert guard.check(Need.METRICS, "Bearer job-key") is not None
    with pytest.raises(Unauthenticated):
        guard.check(Need.INFER, "Bearer nope")
    with pytest.raises(PermissionDenied):
        guard.check(Need.INFER, "Bearer job-key")
    with pytest.raises(PermissionDenied):
        guard.check(Need.ADMIN, "Bearer both-key")
    for need in (Need.INFER, Need.JOBS, Need.ADMIN, Need.ANY):
        assert guard.check(need, "bearer adm-key") is not None
    assert guard.check(Need.ANY, "Bearer job-key") is not None
    assert Guard(KeyStore(None), True, True).check(Need.ADMIN, None) is None


@pytest.mark.parametrize(("path", "need"), [
    ("/v2/health/live", Need.HEALTH), ("/v2/health/ready", Need.HEALTH),
    ("/metrics", Need.METRICS), ("/v1/jobs", Need.JOBS), ("/v1/jobs/abc/result", Need.JOBS),
    ("/v2/repository/models/digits/load", Need.ADMIN),
    ("/v2/repository/models/digits/unload", Need.ADMIN),
    ("/v2/repository/index", Need.INFER), ("/v2", Need.INFER),
    ("/v2/models/digits/versions/1/infer", Need.INFER), ("/v2/models/stats", Need.INFER),
    ("/docs", Need.INFER), ("/openapi.json", Need.INFER),
    ("/v2/health/../repository/models/x/unload", Need.ANY), ("/admin", Need.ANY),
    ("/v1/jobsx", Need.ANY),
])
def test_http_paths_map_to_the_documented_scopes(path: str, need: Need) -> None:
    assert http_need(path) is need


@pytest.fixture
def client(keys_file: Path) -> Iterator[TestClient]:
    """The real app (no lifespan: nothing here reaches Redis) with a keys file."""
    app = create_app(Settings(api_keys_file=keys_file, model_repository=TEST_MODELS,
                              models="echo"))
    with_client = TestClient(app)
    yield with_client
    with_client.close()


def test_http_without_a_valid_key_is_401_with_a_bearer_challenge(client: TestClient) -> None:
    for response in (client.get("/v2"), client.get("/v2", headers=bearer("wrong")),
                     client.post("/v2/models/echo/infer", content=b"{}"),
                     client.post("/v2/repository/models/echo/unload")):
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert "error" in response.json()


def test_http_keys_reach_what_their_scopes_cover(client: TestClient) -> None:
    assert client.get("/v2", headers=bearer("inf-key")).status_code == 200
    assert client.get("/v2/models/echo", headers=bearer("inf-key")).status_code == 200
    assert client.get("/docs", headers=bearer("inf-key")).status_code == 200
    assert client.get("/v2/models/echo", headers=bearer("adm-key")).status_code == 200
    denied = client.get("/v2/models/echo", headers=bearer("job-key"))
    assert denied.status_code == 403 and "infer" in denied.json()["error"]
    assert client.post("/v2/repository/models/echo/unload",
                       headers=bearer("inf-key")).status_code == 403
    assert client.post("/v1/jobs", headers=bearer("inf-key")).status_code == 403


def test_unknown_paths_need_a_key_before_they_are_a_404(client: TestClient) -> None:
    assert client.get("/v2/secret").status_code == 401
    assert client.get("/v2/secret", headers=bearer("job-key")).status_code == 404


def test_health_is_open_unless_auth_health(client: TestClient, keys_file: Path) -> None:
    assert client.get("/v2/health/live").status_code == 200
    strict = TestClient(create_app(Settings(api_keys_file=keys_file, auth_health=True,
                                            model_repository=TEST_MODELS, models="echo")))
    assert strict.get("/v2/health/live").status_code == 401
    assert strict.get("/v2/health/live", headers=bearer("job-key")).status_code == 200


def test_metrics_are_open_unless_auth_metrics(keys_file: Path) -> None:
    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def guarded(auth_metrics: bool) -> TestClient:
        return TestClient(AuthGuard(inner, Guard(KeyStore(keys_file), False, auth_metrics)))

    assert guarded(False).get("/metrics").status_code == 200
    assert guarded(True).get("/metrics").status_code == 401
    assert guarded(True).get("/metrics", headers=bearer("inf-key")).status_code == 200


def test_without_a_keys_file_nothing_is_asked(tmp_path: Path) -> None:
    open_app = TestClient(create_app(Settings(model_repository=TEST_MODELS, models="echo")))
    assert open_app.get("/v2").status_code == 200


# --- gRPC --------------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "need"), [
    ("ServerLive", Need.HEALTH), ("ServerReady", Need.HEALTH), ("ModelReady", Need.HEALTH),
    ("ServerMetadata", Need.INFER), ("ModelMetadata", Need.INFER), ("ModelInfer", Need.INFER),
    ("ModelStreamInfer", Need.INFER), ("ModelConfig", Need.INFER),
    ("ModelStatistics", Need.INFER), ("RepositoryIndex", Need.INFER),
    ("RepositoryModelLoad", Need.ADMIN), ("RepositoryModelUnload", Need.ADMIN),
])
def test_grpc_methods_map_to_the_documented_scopes(method: str, need: Need) -> None:
    assert grpc_need(f"/inference.GRPCInferenceService/{method}") is need
    assert grpc_need("/grpc.health.v1.Health/Check") is Need.HEALTH
    assert grpc_need("/other.Service/Call") is Need.ANY


class Servicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """Answers without a model: enough to tell a call that got through."""

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="conveyor")

    async def RepositoryModelUnload(self, request: Any,
                                    context: Any) -> pb.RepositoryModelUnloadResponse:
        return pb.RepositoryModelUnloadResponse()

    async def ModelStreamInfer(self, request_iterator: Any,
                               context: Any) -> AsyncIterator[pb.ModelStreamInferResponse]:
        async for request in request_iterator:
            yield pb.ModelStreamInferResponse(
                infer_response=pb.ModelInferResponse(id=request.id))


async def grpc_calls(keys_file: Path) -> dict[str, Any]:
    """Each call's outcome (its answer, or its status code) against a real grpc.aio server."""
    server = grpc.aio.server(interceptors=[AuthInterceptor(Guard(KeyStore(keys_file), False,
                                                                 False))])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    outcomes: dict[str, Any] = {}

    async def call(name: str, rpc: Any, *args: Any, metadata: Any = ()) -> None:
        try:
            outcomes[name] = await rpc(*args, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            outcomes[name] = exc.code()

    async def stream(name: str, stub: Any, metadata: Any = ()) -> None:
        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            yield pb.ModelInferRequest(model_name="m", id="a")
        try:
            outcomes[name] = [r.infer_response.id async for r in
                              stub.ModelStreamInfer(requests(), metadata=metadata)]
        except grpc.aio.AioRpcError as exc:
            outcomes[name] = exc.code()

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            await call("live", stub.ServerLive, pb.ServerLiveRequest())
            await call("meta-none", stub.ServerMetadata, pb.ServerMetadataRequest())
            await call("meta-wrong", stub.ServerMetadata, pb.ServerMetadataRequest(),
                       metadata=(("authorization", "Bearer nope"),))
            await call("meta-jobs", stub.ServerMetadata, pb.ServerMetadataRequest(),
                       metadata=(("authorization", "Bearer job-key"),))
            await call("meta-infer", stub.ServerMetadata, pb.ServerMetadataRequest(),
                       metadata=(("authorization", "Bearer inf-key"),))
            await call("meta-bare", stub.ServerMetadata, pb.ServerMetadataRequest(),
                       metadata=(("authorization", "inf-key"),))
            await call("unload-infer", stub.RepositoryModelUnload,
                       pb.RepositoryModelUnloadRequest(model_name="m"),
                       metadata=(("authorization", "Bearer inf-key"),))
            await call("unload-admin", stub.RepositoryModelUnload,
                       pb.RepositoryModelUnloadRequest(model_name="m"),
                       metadata=(("authorization", "Bearer adm-key"),))
            await stream("stream-none", stub)
            await stream("stream-jobs", stub, (("authorization", "Bearer job-key"),))
            await stream("stream-infer", stub, (("authorization", "Bearer inf-key"),))
    finally:
        await server.stop(0)
    return outcomes


def test_grpc_calls_need_a_key_with_the_scope_streams_included(keys_file: Path) -> None:
    got = asyncio.run(grpc_calls(keys_file))
    assert got["live"].live
    assert got["meta-none"] == grpc.StatusCode.UNAUTHENTICATED
    assert got["meta-wrong"] == grpc.StatusCode.UNAUTHENTICATED
    assert got["meta-jobs"] == grpc.StatusCode.PERMISSION_DENIED
    assert got["meta-infer"].name == "conveyor"
    assert got["meta-bare"].name == "conveyor"
    assert got["unload-infer"] == grpc.StatusCode.PERMISSION_DENIED
    assert isinstance(got["unload-admin"], pb.RepositoryModelUnloadResponse)
    assert got["stream-none"] == grpc.StatusCode.UNAUTHENTICATED
    assert got["stream-jobs"] == grpc.StatusCode.PERMISSION_DENIED
    assert got["stream-infer"] == ["a"]
