"""One bad model, one bad name or a stale repository state never darkens the rest.

Pure functions, one API process (HTTP and gRPC) per test against a real Redis, with
heartbeats written by hand, and the supervisor's repository handling without spawning
processes.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import grpc
import httpx
import pytest
import redis
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from batching.keys import Keys
from batching.names import model_folder, valid_name
from batching.repository_scan import scan_repository, scrub_paths, stale_entries, status_table
from batching.settings import Settings
from conveyor import cli
from tests.conftest import TEST_MODELS, MakeStack
from tests.procs import RedisServer, free_port, service_env, start_api, wait_for
from workers.supervisor import Supervisor

LONG = "a" * 300


def test_names() -> None:
    for good in ("digits", "a.b", "a-b_c.1", "x" * 128, "..a"[1:]):
        assert valid_name(good), good
    for bad in ("", ".", "..", "a..b", "../x", "/tmp/x", "a/b", "a b", "é", "x" * 129, LONG,
                "a\x00b"):
        assert not valid_name(bad), bad


def test_model_folder_stays_inside_the_repository(tmp_path: Path) -> None:
    root, outside = tmp_path / "repo", tmp_path / "outside"
    (root / "good").mkdir(parents=True)
    (outside / "evil").mkdir(parents=True)
    (root / "escape").symlink_to(outside / "evil")
    (root / "alias").symlink_to(root / "good")
    assert model_folder(root, "good") == root / "good"
    assert model_folder(root, "alias") == root / "alias"
    for name in ("escape", "missing", "../outside/evil", str(outside / "evil"), LONG):
        assert model_folder(root, name) is None, name


def _repository(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(TEST_MODELS / "echo", root / "echo")
    (root / "yaml_broken").mkdir()
    (root / "yaml_broken" / "config.yaml").write_text("backend: python\nmax_batch_size: [1\n")
    (root / "schema_broken").mkdir()
    (root / "schema_broken" / "config.yaml").write_text("backend: python\nmax_batch_size: -3\n")
    return root


def test_scan_keeps_the_good_models_and_the_reasons_of_the_broken(tmp_path: Path) -> None:
    root = _repository(tmp_path)
    scan = scan_repository(root)
    assert set(scan.models) == {"echo"}
    assert set(scan.failed) == {"yaml_broken", "schema_broken"}
    assert scan.failed["yaml_broken"].startswith("yaml_broken")
    assert "max_batch_size" in scan.failed["schema_broken"]
    assert str(tmp_path) not in " ".join(scan.failed.values())
    table = status_table([("echo", "LOADED"), ("schema_broken", "UNAVAILABLE: bad")])
    assert "| Model         | Version | Status           |" in table.splitlines()
    assert stale_entries(root, ["echo", "gone", "../repo/echo", "schema_broken"]) == [
        "../repo/echo", "gone"]


def test_scrub_paths(tmp_path: Path) -> None:
    text = (f"[Errno 2] No such file: '{tmp_path}/m/w.bin' in /usr/lib/python3/x.py "
            "from https://example.com/a/b")
    assert scrub_paths(text, tmp_path) == (
        "[Errno 2] No such file: 'm/w.bin' in x.py from https://example.com/a/b")


def _start(settings: Settings, logdir: Path) -> Iterator[httpx.Client]:
    """An API process (uvicorn) with ``settings``' Redis, repository, prefix and ports."""
    env = service_env(settings.redis_url, settings.model_repository, settings.key_prefix,
                      CONVEYOR_GRPC_PORT=str(settings.grpc_port),
                      CONVEYOR_HEARTBEAT_INTERVAL_S=str(settings.heartbeat_interval_s),
                      CONVEYOR_MODEL_CONTROL=settings.model_control)
    proc, url = start_api(env, logdir, f"api-{settings.key_prefix}")
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client
    finally:
        proc.stop()


Api = tuple[httpx.Client, Settings]
"""The ``api`` fixture: a client of the API process and the settings it runs with."""


@pytest.fixture
def api(redis_server: RedisServer, tmp_path: Path,
        logdir: Path) -> Iterator[Api]:
    settings = Settings(redis_url=redis_server.url, model_repository=_repository(tmp_path),
                        key_prefix=f"mf{time.monotonic_ns()}", grpc_port=free_port(),
                        heartbeat_interval_s=0.1, model_control="explicit")
    keys = Keys(settings.key_prefix)
    with redis.Redis.from_url(settings.redis_url) as client:
        # Left from an earlier repository: a model that is gone, a path, and a real unload.
        for name, state in (("gone", "loaded"), ("../x", "loaded"), ("schema_broken", "unloaded")):
            client.hset(keys.repository(), name, json.dumps({"state": state, "ts": 1.0}))
        client.hset(keys.repository(), "yaml_broken", "{written by hand")  # read as no state
    for http in _start(settings, logdir):
        yield http, settings


def _beat(settings: Settings, model: str, state: str, **extra: object) -> None:
    with redis.Redis.from_url(settings.redis_url) as client:
        client.hset(Keys(settings.key_prefix).workers(model), f"h:1:{model}:cpu:0:slot",
                    json.dumps({"state": state, "model": model, "ts": time.time(), **extra}))


def test_broken_configs_are_unavailable_and_the_rest_serves(api: Api, logdir: Path) -> None:
    client, settings = api
    log = "".join(p.read_text() for p in logdir.glob(f"api-{settings.key_prefix}-*.log"))
    assert "| Model         | Version | Status " in log
    assert "| yaml_broken   | 1       | UNAVAILABLE: yaml_broken: " in log
    assert "| schema_broken | 1       | UNLOADED" in log
    index = {e["name"]: e for e in client.post("/v2/repository/index").json()}
    assert index["yaml_broken"]["state"] == "UNAVAILABLE"
    assert index["yaml_broken"]["reason"].startswith("yaml_broken")
    assert index["schema_broken"] == {"name": "schema_broken", "version": "1",
                                      "state": "UNAVAILABLE", "reason": "unloaded"}
    assert client.get("/v2/models/echo").status_code == 200
    answer = client.get("/v2/models/yaml_broken")
    assert answer.status_code == 404 and "unavailable: yaml_broken" in answer.json()["error"]
    metrics = client.get("/metrics").text
    assert 'conveyor_model_state{model="yaml_broken",state="UNAVAILABLE"} 1.0' in metrics
    assert 'conveyor_model_state{model="echo",state="READY"} 0.0' in metrics


def test_stale_repository_state_is_dropped_at_start(api: Api) -> None:
    _, settings = api
    with redis.Redis.from_url(settings.redis_url) as client:
        recorded = client.hkeys(Keys(settings.key_prefix).repository())
    assert sorted(recorded) == [b"schema_broken", b"yaml_broken"]


def answer(shown: str, path: str, unknown: str) -> str:
    """The unknown-model answer; a load puts Triton's "failed to load" before it."""
    if path == "load":
        return f"failed to load {shown!r}, failed to poll from model repository: {unknown}"
    return unknown


def test_bad_names_get_one_answer_on_every_path(api: Api) -> None:
    client, settings = api
    outside = settings.model_repository.parent / "outside"
    shutil.copytree(TEST_MODELS / "echo", outside / "evil")
    (settings.model_repository / "escape").symlink_to(outside / "evil")
    for name in ("missing", "escape", "a..b", LONG, "bad name"):
        shown = name if len(name) <= 128 else name[:128] + "..."
        expected = f"Request for unknown model: {shown!r} is not found"
        for method, path in (("post", "load"), ("post", "unload"), ("get", "ready"),
                             ("get", "config"), ("get", "stats"), ("post", "infer")):
            response = client.request(method, f"/v2/models/{name}/{path}" if method == "get"
                                      or path == "infer" else
                                      f"/v2/repository/models/{name}/{path}", json={})
            assert response.status_code == 404, (name, path, response.text)
            assert response.json() == {"error": answer(shown, path, expected)}, (name, path)
    with grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for name in ("/tmp/x/evil", "../repo/echo", str(outside / "evil"), LONG, "escape", ".."):
            shown = name if len(name) <= 128 else name[:128] + "..."
            calls = ((stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name=name)),
                     (stub.RepositoryModelUnload,
                      pb.RepositoryModelUnloadRequest(model_name=name)),
                     (stub.ModelMetadata, pb.ModelMetadataRequest(name=name)),
                     (stub.ModelConfig, pb.ModelConfigRequest(name=name)))
            for method, request in calls:
                with pytest.raises(grpc.RpcError) as caught:
                    method(request, timeout=10)
                assert caught.value.code() == grpc.StatusCode.NOT_FOUND, (name, caught.value)
                path = "load" if method is stub.RepositoryModelLoad else ""
                assert caught.value.details() == answer(
                    shown, path, f"Request for unknown model: {shown!r} is not found")
            ready = stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=10)
            assert not ready.ready
    names = [e["name"] for e in client.post("/v2/repository/index").json()]
    assert "escape" not in names


def test_unmatched_routes_answer_error(api: Api) -> None:
    client, _ = api
    assert client.get("/nope").json() == {"error": "Not Found"}
    response = client.get("/v2/repository/index")
    assert response.status_code == 405 and response.json() == {"error": "Method Not Allowed"}
    response = client.get("/v1/jobs?limit=many")
    assert response.status_code == 422
    assert response.json()["error"].startswith("invalid request: query.limit: ")


def test_readiness_counts_failed_models_as_settled(api: Api) -> None:
    client, settings = api
    assert client.get("/v2/health/ready").status_code == 503  # echo: no worker yet
    _beat(settings, "echo", "failed", reason="echo: RuntimeError: boom", since=time.time())
    wait_for(lambda: client.get("/v2/health/ready").status_code == 200, 5,
             "readiness with echo failed")
    ready = client.get("/v2/models/echo/ready")
    assert ready.status_code == 503
    assert ready.json() == {"error": "model 'echo' failed to load: echo: RuntimeError: boom"}
    entry = [e for e in client.post("/v2/repository/index").json() if e["name"] == "echo"]
    assert entry == [{"name": "echo", "version": "1", "state": "UNAVAILABLE",
                      "reason": "echo: RuntimeError: boom"}]


def test_load_answers_when_a_worker_reports_failure(api: Api) -> None:
    client, settings = api
    _beat(settings, "echo", "failed", reason="echo: old failure", since=time.time() - 5)
    answers: list[httpx.Response] = []
    loading = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{client.base_url}/v2/repository/models/echo/load", timeout=30)))
    started = time.monotonic()
    loading.start()
    time.sleep(1.0)
    assert not answers, "a failure reported before the load is not its answer"
    _beat(settings, "echo", "failed", reason="echo: RuntimeError: boom", since=time.time())
    loading.join(10)
    assert time.monotonic() - started < 5
    assert answers[0].status_code == 400
    assert answers[0].json() == {"error": "failed to load model 'echo': echo: RuntimeError: boom"}


def test_control_mode_none_refuses_load_and_unload(redis_server: RedisServer,
                                                   logdir: Path) -> None:
    settings = Settings(redis_url=redis_server.url, model_repository=TEST_MODELS,
                        key_prefix=f"mf{time.monotonic_ns()}", grpc_port=free_port(),
                        model_control="none")
    for client in _start(settings, logdir):
        for action in ("load", "unload"):
            response = client.post(f"/v2/repository/models/echo/{action}")
            assert response.status_code == 503
            assert "explicit model load / unload is not allowed" in response.json()["error"]
        with grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="echo"),
                                           timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_supervisor_ignores_bad_names_and_adds_slots_once(tmp_path: Path) -> None:
    root = _repository(tmp_path)
    outside = tmp_path / "outside"
    shutil.copytree(TEST_MODELS / "echo", outside / "evil")
    (root / "escape").symlink_to(outside / "evil")
    os.environ.pop("CONVEYOR_MODELS", None)
    supervisor = Supervisor(Settings(model_repository=root, redis_url="redis://127.0.0.1:1/0"))
    assert sorted(supervisor.models) == ["echo"]
    loaded = json.dumps({"state": "loaded", "ts": 1.0}).encode()
    states: dict[bytes | str, bytes | str] = {
        name.encode(): loaded
        for name in (str(outside / "evil"), "../outside/evil", "escape", "echo", "yaml_broken", LONG)}
    states[b"schema_broken"] = b"{written by hand"
    for _ in range(5):
        supervisor._apply_repository(states)
    assert [s.model for s in supervisor.slots] == ["echo"]
    supervisor._add_slots(supervisor.models["echo"])
    supervisor._add_slots(supervisor.models["echo"])
    supervisor._apply_repository(states)
    assert [s.model for s in supervisor.slots] == ["echo"]


def test_a_model_that_raises_while_loading_fails_alone(make_stack: MakeStack, tmp_path: Path) -> None:
    """Real worker: the failing model's reason reaches the index and a load at once, the
    server is ready with the rest, and names in Redis that are no folder start nothing."""
    root = tmp_path / "repo"
    shutil.copytree(TEST_MODELS / "echo", root / "echo")
    shutil.copytree(TEST_MODELS / "echo", root / "boom")
    (root / "boom" / "model.py").write_text(
        "class Model:\n    def __init__(self, config, device):\n"
        "        raise RuntimeError(f'cannot open {__file__}')\n")
    shutil.copytree(TEST_MODELS / "echo", tmp_path / "outside" / "evil")
    stack = make_stack(repository=root, CONVEYOR_MODEL_CONTROL="explicit")
    stack.add_api()
    worker = stack.add_worker()
    stack.wait_ready(timeout=90)
    reason = "boom: RuntimeError: cannot open boom/model.py"
    entries = {e["name"]: e for e in httpx.post(f"{stack.url}/v2/repository/index").json()}
    assert entries["boom"] == {"name": "boom", "version": "1", "state": "UNAVAILABLE",
                               "reason": reason}
    assert entries["echo"]["state"] == "READY"

    started = time.monotonic()
    answer = httpx.post(f"{stack.url}/v2/repository/models/boom/load", timeout=150)
    assert answer.status_code == 400
    assert answer.json() == {"error": f"failed to load model 'boom': {reason}"}
    assert time.monotonic() - started < 30

    client = stack.redis()
    loaded = json.dumps({"state": "loaded", "ts": time.time()})
    for name in (str(tmp_path / "outside" / "evil"), "../outside/evil", LONG):
        client.hset(f"{stack.prefix}:repository", name, loaded)
    time.sleep(3)  # three supervisor ticks
    probe = httpx.get(f"http://127.0.0.1:{worker.probe_port}/ready")
    assert probe.status_code == 200, "a failed model is settled for the worker's probe too"
    slots = probe.json()["slots"]
    assert sorted(s["model"] for s in slots) == ["boom", "echo"]
    assert worker.log().count("not a model folder of this repository") == 3  # once each


def test_models_cli_lists_loads_unloads_and_resets(redis_server: RedisServer, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    root = _repository(tmp_path)
    prefix = f"cli{time.monotonic_ns()}"
    url = redis_server.url.replace("redis://", "redis://:S3cret@")
    monkeypatch.setenv("CONVEYOR_REDIS_URL", redis_server.url)
    monkeypatch.setenv("CONVEYOR_MODEL_REPOSITORY", str(root))
    monkeypatch.setenv("CONVEYOR_KEY_PREFIX", prefix)
    monkeypatch.delenv("CONVEYOR_MODELS", raising=False)
    client = redis.Redis.from_url(redis_server.url)
    client.hset(f"{prefix}:repository", "gone", json.dumps({"state": "unloaded", "ts": 1.0}))
    _beat(Settings(redis_url=redis_server.url, key_prefix=prefix), "echo", "ready")

    assert cli.main(["models", "unload", "echo"]) == 0
    assert cli.main(["models", "load", "../outside"]) == 1
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "| echo          | 1       | folder ok; recorded unloaded; workers 1 ready" in out
    assert "| gone          | 1       | folder absent; recorded unloaded; workers -" in out
    assert "yaml_broken   | 1       | folder invalid: yaml_broken: " in out
    recorded = json.loads(cast(bytes, client.hget(f"{prefix}:repository", "echo")))
    assert recorded["state"] == "unloaded" and recorded["ts"] > 1.0

    assert cli.main(["models", "reset", "gone"]) == 0
    assert client.hkeys(f"{prefix}:repository") == [b"echo"]
    assert cli.main(["models", "reset"]) == 0
    assert not client.exists(f"{prefix}:repository")
    client.close()

    monkeypatch.setenv("CONVEYOR_REDIS_URL", url.replace(str(redis_server.port), "1"))
    assert cli.main(["models", "list"]) == 1
    assert "S3cret" not in capsys.readouterr().err
