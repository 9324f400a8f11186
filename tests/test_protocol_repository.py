"""Repository control through tritonclient: index, unload (in-flight requests finish), load."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeAlias, cast

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import TEST_MODELS, Stack
from tests.procs import RedisServer, free_port, wait_for
from tests.protocol_stack import build_repository, grpc_url, http_host, protocol_stack


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from protocol_stack(redis_server, logdir,
                              build_repository(tmp_path_factory.mktemp("repo-repo")),
                              ECHO_LOG=str(tmp_path_factory.mktemp("ran") / "executed.log"))


def hold(stack: Stack) -> Path:
    """While this file exists, the test models' batches wait before they run."""
    return Path(stack.extra_env["ECHO_LOG"] + ".hold")


def serving(stack: Stack, model: str) -> bool:
    """The worker's inference process for ``model`` is ready, and so not stopping: it
    has not had the unload's stop yet (after it, it reads nothing more)."""
    probe = f"http://127.0.0.1:{stack.workers[0].probe_port}/ready"
    return any(s["model"] == model and s["ready"] for s in httpx.get(probe).json()["slots"])


Client: TypeAlias = httpclient.InferenceServerClient


@pytest.fixture
def http(stack: Stack) -> Iterator[Client]:
    with httpclient.InferenceServerClient(http_host(stack), network_timeout=150) as made:
        yield made


def echo_input(value: float = 1.0) -> httpclient.InferInput:
    item = httpclient.InferInput("x", [1, 4], "FP32")
    item.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return item


def index(stack: Stack) -> dict[str, dict[str, Any]]:
    response = httpx.post(f"{stack.url}/v2/repository/index", content=b"")
    assert response.status_code == 200, response.text
    return {entry["name"]: entry for entry in response.json()}


def test_index_accepts_an_empty_body_and_lists_every_folder(stack: Stack, http: Client) -> None:
    entries = index(stack)
    assert {name: e["state"] for name, e in entries.items()} == dict.fromkeys(
        ["alltypes", "echo", "onnx_mlp", "slow"], "READY")
    ready = httpx.post(f"{stack.url}/v2/repository/index", json={"ready": True}).json()
    assert {e["name"] for e in ready} == set(entries)
    assert len(http.get_model_repository_index()) == 4


def test_index_answers_a_ready_of_the_wrong_type_before_the_body_depth(stack: Stack) -> None:
    """Triton's L0_http test_repository_index_deeply_nested_json, and the depth bound that
    still answers when ``ready`` is a boolean or not found."""
    depth = 250_000
    nested = b"[" * depth + b"true" + b"]" * depth
    deep = b"[" * 2000 + b"]" * 2000

    def answer(body: bytes) -> tuple[int, str]:
        response = httpx.post(f"{stack.url}/v2/repository/index", content=body, timeout=60,
                              headers={"Content-Type": "application/json"})
        return response.status_code, response.json()["error"]

    wrong_type = (400, "Invalid value for 'ready': expected a boolean")
    assert answer(b'{"ready":' + nested + b"}") == wrong_type
    assert answer(b'{"x": "[[\\\"", "ready": ' + deep + b"}") == wrong_type
    assert answer(b'{"x": ' + deep + b', "ready": "yes"}') == wrong_type
    for bound in (b'{"ready": true, "x": ' + deep + b"}",
                  b'{"x": [{"ready": 1}, ' + deep + b"]}",
                  b'{"x": "\\\\", "ready": false, "y": ' + deep + b"}"):
        status, error = answer(bound)
        assert status == 400 and "depth limit exceeded" in error, (bound[:40], error)
    assert httpx.get(f"{stack.url}/v2/health/live", timeout=10).status_code == 200


def test_unload_then_load_over_both_protocols(stack: Stack, http: Client) -> None:
    grpc = grpcclient.InferenceServerClient(grpc_url(stack))
    http.unload_model("echo")
    with pytest.raises(InferenceServerException) as caught:
        http.infer("echo", [echo_input()])
    assert caught.value.status() == "404" and "unloaded" in caught.value.message()
    assert not http.is_model_ready("echo") and not grpc.is_model_ready("echo")
    assert index(stack)["echo"] == {"name": "echo", "version": "1", "state": "UNAVAILABLE",
                                    "reason": "unloaded"}
    assert http.is_server_ready(), "readiness counts loaded models only"
    http.unload_model("echo")  # unloading an unloaded model is not an error

    grpc.load_model("echo")
    assert http.is_model_ready("echo")
    result = http.infer("echo", [echo_input(3.0)])
    np.testing.assert_array_equal(result.as_numpy("y"), np.full((1, 4), 6.0))
    # The heartbeats of the unloaded processes may still be on their way out.
    wait_for(lambda: index(stack)["echo"]["state"] == "READY", 30, "echo to be READY again")
    grpc.close()


def test_a_load_of_a_name_that_is_no_model_says_failed_to_load(stack: Stack,
                                                               http: Client) -> None:
    """Triton's model-control examples look for "failed to load" in this answer."""
    with grpcclient.InferenceServerClient(grpc_url(stack)) as grpc:
        for client in (http, grpc):
            with pytest.raises(InferenceServerException) as caught:
                client.load_model("wrong_model_name")
            assert "failed to load 'wrong_model_name'" in caught.value.message()
            assert "Request for unknown model" in caught.value.message()
    assert http.is_server_live()


def test_in_flight_requests_finish_across_an_unload(stack: Stack, http: Client) -> None:
    """The slow model takes 600 ms a batch; it is unloaded while one request runs: the
    model holds it until the unload's stop has reached the inference process."""
    def infer_in_thread() -> np.ndarray:
        with httpclient.InferenceServerClient(http_host(stack), network_timeout=60) as client:
            return cast(np.ndarray, client.infer("slow", [echo_input(5.0)]).as_numpy("y"))

    client = stack.redis()
    stream = f"{stack.prefix}:{{slow}}:q:2"

    def taken() -> int:
        return int(client.xpending(stream, "workers")["pending"]) if client.exists(stream) else 0

    wait_for(lambda: serving(stack, "slow") and http.is_model_ready("slow"), 60,
             "the slow model to be ready")
    hold(stack).touch()
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(infer_in_thread)
            wait_for(lambda: taken() == 1, 30, "the worker to take the request")
            http.unload_model("slow")
            wait_for(lambda: not serving(stack, "slow"), 30, "the unload to reach the worker")
            hold(stack).unlink()
            np.testing.assert_array_equal(running.result(timeout=60), np.full((1, 4), 10.0))
    finally:
        hold(stack).unlink(missing_ok=True)
    with pytest.raises(InferenceServerException) as caught:
        http.infer("slow", [echo_input()])
    assert caught.value.status() == "404"
    http.load_model("slow")
    assert http.infer("slow", [echo_input(1.0)]).as_numpy("y")[0, 0] == 2.0


def test_requests_left_unread_by_an_unload_get_404_at_once(stack: Stack, http: Client) -> None:
    """40 requests for the slow model (600 ms a batch of up to 8), all admitted while the
    model holds its first batch: the worker has read at most two batches' worth when the
    unload reaches it. It finishes those, and the unread rest is answered with 404, long
    before the deadlines."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}],
            "parameters": {"timeout": 25_000_000}}
    client = stack.redis()
    rows, stream = f"{stack.prefix}:{{slow}}:rows", f"{stack.prefix}:{{slow}}:q:2"

    def added() -> int:
        return int(client.xinfo_stream(stream)["entries-added"]) if client.exists(stream) else 0

    # The previous test loads the model again at its end: its inference process may still be
    # starting, and an unload that reaches it before it runs anything turns all 40 away.
    wait_for(lambda: serving(stack, "slow") and http.is_model_ready("slow"), 60,
             "the slow model to be ready")
    before = added()

    def infer(_: int) -> tuple[int, str, float]:
        response = httpx.post(f"{stack.url}/v2/models/slow/infer", json=body, timeout=60)
        return response.status_code, response.text, time.monotonic()

    hold(stack).touch()
    try:
        with ThreadPoolExecutor(40) as pool:
            results = pool.map(infer, range(40))
            wait_for(lambda: added() - before == 40, 30, "all 40 requests admitted")
            unloaded = time.monotonic()
            http.unload_model("slow")
            wait_for(lambda: not serving(stack, "slow"), 30, "the unload to reach the worker")
            hold(stack).unlink()
            outcomes = list(results)
    finally:
        hold(stack).unlink(missing_ok=True)
    statuses = [status for status, _, _ in outcomes]
    assert set(statuses) == {200, 404} and statuses.count(200) <= 16, sorted(statuses)
    assert all("was unloaded before this request ran" in text
               for status, text, _ in outcomes if status == 404)
    assert max(at for _, _, at in outcomes) - unloaded < 10  # not at the 25 s deadline
    wait_for(lambda: int(client.get(rows) or 0) == 0, 10,
             "the rows of the turned-away requests to be released")
    http.load_model("slow")


def test_hot_load_of_a_new_folder_and_a_broken_one(stack: Stack, http: Client) -> None:
    shutil.copytree(TEST_MODELS / "echo", stack.repository / "echo_late")
    assert index(stack)["echo_late"] == {"name": "echo_late", "version": "1",
                                         "state": "UNAVAILABLE", "reason": "not loaded"}
    with pytest.raises(InferenceServerException) as caught:
        http.infer("echo_late", [echo_input()])
    assert caught.value.status() == "404"
    http.load_model("echo_late")
    result = http.infer("echo_late", [echo_input(4.0)])
    np.testing.assert_array_equal(result.as_numpy("y"), np.full((1, 4), 8.0))
    assert http.get_model_config("echo_late")["name"] == "echo_late"

    broken = stack.repository / "broken"
    broken.mkdir()
    (broken / "config.yaml").write_text("backend: python\nmax_batch_size: -3\n")
    with pytest.raises(InferenceServerException) as caught:
        http.load_model("broken")
    assert caught.value.status() == "400" and "max_batch_size" in caught.value.message()
    entry = index(stack)["broken"]
    assert entry["state"] == "UNAVAILABLE" and "max_batch_size" in entry["reason"]


def test_a_second_api_process_follows_the_repository_hash(stack: Stack, http: Client) -> None:
    first_grpc_port = stack.extra_env["CONVEYOR_GRPC_PORT"]
    stack.extra_env["CONVEYOR_GRPC_PORT"] = str(free_port())  # the first one holds its own
    try:
        other = stack.add_api()
    finally:
        stack.extra_env["CONVEYOR_GRPC_PORT"] = first_grpc_port

    def ready_there() -> bool:
        return httpx.get(f"{other}/v2/models/alltypes/ready").status_code == 200

    wait_for(ready_there, 30, "the second API to see workers")
    http.unload_model("alltypes")
    wait_for(lambda: httpx.get(f"{other}/v2/models/alltypes").status_code == 404, 10,
             "the second API to drop the unloaded model")
    http.load_model("alltypes")
    wait_for(ready_there, 30, "the second API to load it again")
