"""API keys (api.auth), the HTTP guard around the whole app and the gRPC interceptor.

Nothing here imports ``api.proto`` (or ``api.main``, which does): its ``inference.*``
symbols would collide with tritonclient's in the test process (see test_protocol_proto).
The real app runs as a process; gRPC calls go out as raw bytes.
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from api.auth import PRINCIPAL, Guard, KeyStore, Need, Scope, key_digest, parse_keys
from api.auth_grpc import AuthInterceptor, grpc_need
from api.auth_http import AuthGuard, http_need
from batching.errors import PermissionDenied, Unauthenticated
from tests.conftest import TEST_MODELS, Stack
from tests.procs import RedisServer, free_port

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
    ("/metrics", Need.METRICS), ("/v2/conveyor/queues", Need.METRICS),
    ("/v1/jobs", Need.JOBS), ("/v1/jobs/abc/result", Need.JOBS),
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


def guarded(keys_file: Path, auth_health: bool = False, auth_metrics: bool = False,
            seen: list[Any] | None = None) -> TestClient:
    """AuthGuard around an app that answers 200 and records the principal it was given."""
    async def inner(scope: Any, receive: Any, send: Any) -> None:
        if seen is not None:
            seen.append(scope[PRINCIPAL])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return TestClient(AuthGuard(inner, Guard(KeyStore(keys_file), auth_health, auth_metrics)))


def test_the_guard_answers_401_and_403_before_the_app_and_hands_it_the_principal(
        keys_file: Path) -> None:
    seen: list[Any] = []
    client = guarded(keys_file, seen=seen)
    missing = client.get("/v2")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json() == {"error": "an API key is required (Authorization: Bearer <key>)"}
    assert client.get("/v2", headers=bearer("wrong")).status_code == 401
    denied = client.get("/v2", headers=bearer("job-key"))
    assert denied.status_code == 403 and "'infer'" in denied.json()["error"]
    assert "insufficient_scope" in denied.headers["www-authenticate"]
    assert seen == []
    assert client.get("/v2", headers=bearer("inf-key")).status_code == 200
    assert seen[0].digest == key_digest("inf-key")


def test_health_and_metrics_are_open_unless_asked(keys_file: Path) -> None:
    assert guarded(keys_file).get("/v2/health/live").status_code == 200
    assert guarded(keys_file).get("/metrics").status_code == 200
    assert guarded(keys_file, auth_health=True).get("/v2/health/ready").status_code == 401
    assert guarded(keys_file, auth_health=True).get(
        "/v2/health/ready", headers=bearer("job-key")).status_code == 200
    assert guarded(keys_file, auth_metrics=True).get("/metrics").status_code == 401
    assert guarded(keys_file, auth_metrics=True).get(
        "/metrics", headers=bearer("inf-key")).status_code == 200


# --- gRPC: the interceptor on a real grpc.aio server ---------------------------------------

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


SERVICE = "inference.GRPCInferenceService"


async def _echo(request: bytes, context: Any) -> bytes:
    return b"ok:" + request


async def _echo_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for request in requests:
        yield b"ok:" + request


async def raw_calls(target: str, calls: list[tuple[str, str, str | None]]) -> list[Any]:
    """Each (kind, method, key) call's answer, or its status code; raw bytes both ways."""
    async with grpc.aio.insecure_channel(target) as channel:
        return [await _raw_call(channel, *call) for call in calls]


async def _raw_call(channel: grpc.aio.Channel, kind: str, method: str, key: str | None) -> Any:
    """One call's answer or status code. A stream refused at once races grpc.aio's own
    write of its first message: when that write loses, the client library reports its
    failed send as INTERNAL ("execute_batch") in place of the server's status, so the
    call is made again (the server never answers INTERNAL here)."""
    metadata = (("authorization", key),) if key else ()
    path = f"/{SERVICE}/{method}"
    for _ in range(5):
        try:
            if kind == "unary":
                return await channel.unary_unary(path)(b"", metadata=metadata)

            async def one() -> AsyncIterator[bytes]:
                yield b""
            return [r async for r in channel.stream_stream(path)(one(), metadata=metadata)]
        except grpc.aio.AioRpcError as exc:
            lost_to_the_client = (exc.code() == grpc.StatusCode.INTERNAL
                                  and "execute_batch" in (exc.details() or ""))
            if not lost_to_the_client:
                return exc.code()
    return grpc.StatusCode.INTERNAL


CALLS: list[tuple[str, str, str | None]] = [
    ("unary", "ServerLive", None), ("unary", "ServerMetadata", None),
    ("unary", "ServerMetadata", "Bearer nope"), ("unary", "ServerMetadata", "Bearer job-key"),
    ("unary", "ServerMetadata", "Bearer inf-key"), ("unary", "ServerMetadata", "inf-key"),
    ("unary", "RepositoryModelUnload", "Bearer inf-key"),
    ("unary", "RepositoryModelUnload", "Bearer adm-key"),
    ("stream", "ModelStreamInfer", None), ("stream", "ModelStreamInfer", "Bearer job-key"),
    ("stream", "ModelStreamInfer", "Bearer inf-key"),
]
DENIED = grpc.StatusCode.UNAUTHENTICATED
FORBIDDEN = grpc.StatusCode.PERMISSION_DENIED


def test_grpc_calls_need_a_key_with_the_scope_streams_included(keys_file: Path) -> None:
    async def scenario() -> list[Any]:
        guard = Guard(KeyStore(keys_file), False, False)
        server = grpc.aio.server(interceptors=[AuthInterceptor(guard)])
        handlers = {name: grpc.unary_unary_rpc_method_handler(_echo) for name in
                    ("ServerLive", "ServerMetadata", "RepositoryModelUnload")}
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(_echo_stream)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE,
                                                                              handlers),))
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            return await raw_calls(f"127.0.0.1:{port}", CALLS)
        finally:
            await server.stop(0)

    assert asyncio.run(scenario()) == [
        b"ok:", DENIED, DENIED, FORBIDDEN, b"ok:", b"ok:", FORBIDDEN, b"ok:",
        DENIED, FORBIDDEN, [b"ok:"]]


# --- The real API process: the guard wraps everything, the interceptor is on --------------

@pytest.fixture(scope="module")
def api(redis_server: RedisServer, logdir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, int]]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(KEYS)
    grpc_port = free_port()
    stack = Stack(redis_server.url, TEST_MODELS, logdir, extra_env={
        "CONVEYOR_API_KEYS_FILE": str(keys), "CONVEYOR_MODELS": "echo",
        "CONVEYOR_GRPC_PORT": str(grpc_port)})
    stack.add_api()
    yield stack, grpc_port
    stack.stop()


def test_the_api_refuses_http_without_a_key_infer_hot_path_included(
        api: tuple[Stack, int]) -> None:
    url = api[0].url
    for response in (httpx.get(f"{url}/v2"), httpx.get(f"{url}/v2", headers=bearer("wrong")),
                     httpx.post(f"{url}/v2/models/echo/infer", content=b"{}"),
                     httpx.post(f"{url}/v2/repository/models/echo/unload"),
                     httpx.get(f"{url}/v1/jobs/0123"), httpx.get(f"{url}/v2/nothing/here")):
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
        assert "error" in response.json()
    assert httpx.get(f"{url}/v2/health/live").status_code == 200


def test_the_api_lets_keys_reach_what_their_scopes_cover(api: tuple[Stack, int]) -> None:
    url = api[0].url
    assert httpx.get(f"{url}/v2", headers=bearer("inf-key")).status_code == 200
    assert httpx.get(f"{url}/v2/models/echo", headers=bearer("adm-key")).status_code == 200
    assert httpx.get(f"{url}/docs", headers=bearer("inf-key")).status_code == 200
    assert httpx.get(f"{url}/v2/models/echo", headers=bearer("job-key")).status_code == 403
    assert httpx.post(f"{url}/v2/repository/models/echo/unload",
                      headers=bearer("inf-key")).status_code == 403
    assert httpx.get(f"{url}/v2/nothing/here", headers=bearer("job-key")).status_code == 404


def test_the_api_grpc_endpoint_has_the_interceptor(api: tuple[Stack, int]) -> None:
    got = asyncio.run(raw_calls(f"127.0.0.1:{api[1]}", [
        ("unary", "ServerMetadata", None), ("unary", "RepositoryModelLoad", "Bearer inf-key"),
        ("stream", "ModelStreamInfer", "Bearer job-key"), ("unary", "ServerLive", None)]))
    assert got[:3] == [DENIED, FORBIDDEN, FORBIDDEN]
    assert isinstance(got[3], bytes)  # open: a ServerLiveResponse, serialized
