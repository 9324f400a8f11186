"""Reloads: under load, with real processes, a failed one leaves the loaded version serving
and a successful one swaps it, neither costing a request; the supervisor's staging alone."""

from __future__ import annotations

import json
import math
import multiprocessing
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from batching.keys import Keys
from batching.repository_scan import config_digest, record_value
from batching.settings import Settings
from batching.triton_repository import json_config
from tests.conftest import MODELS, TEST_MODELS, Stack
from tests.procs import RedisServer, wait_for
from tests.protocol_stack import grpc_url, protocol_stack
from workers.control import attach, worker_info
from workers.shared_state import ProcState, SharedState
from workers.slot import Slot
from workers.supervisor import Supervisor

PIXELS = np.random.default_rng(3).random((1, 64), dtype=np.float32)
BODY = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64],
                    "data": PIXELS.ravel().tolist()}]}
CANNOT_LOAD = '{"backend": "python"}'
"""A configuration the API accepts that no worker can load: the folder has no model.py."""


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("reload-repo")
    shutil.copytree(MODELS / "digits", root / "digits")
    yield from protocol_stack(redis_server, logdir, root)


class Traffic:
    """HTTP and gRPC requests for digits, back to back from a few threads, counted by status."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.statuses: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._http) for _ in range(3)]
        self._threads.append(threading.Thread(target=self._grpc))

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def total(self) -> int:
        with self._lock:
            return sum(self.statuses.values())

    def _count(self, status: str) -> None:
        with self._lock:
            self.statuses[status] += 1

    def _http(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    answer = client.post(f"{self.stack.url}/v2/models/digits/infer", json=BODY)
                    self._count(str(answer.status_code))
                except httpx.HTTPError as exc:
                    self._count(type(exc).__name__)

    def _grpc(self) -> None:
        item = grpcclient.InferInput("pixels", [1, 64], "FP32")
        item.set_data_from_numpy(PIXELS)
        with grpcclient.InferenceServerClient(grpc_url(self.stack)) as client:
            while not self._stop.is_set():
                try:
                    client.infer("digits", [item], client_timeout=60)
                    self._count("200")
                except InferenceServerException as exc:
                    self._count(f"grpc {exc.status()}")


def failed_beat(stack: Stack, digest: str, since: float) -> bool:
    """A supervisor reports that digits failed to load with the configuration of ``digest``."""
    beats = stack.redis().hvals(Keys(stack.prefix).workers("digits"))
    return any(beat.get("state") == "failed" and beat.get("config") == digest
               and beat.get("since", 0) > since for beat in map(json.loads, beats))


def api_dropped(stack: Stack) -> int:
    """How many reloads recorded in the hash the API saw fail (and kept what serves)."""
    return stack.apis[0][0].log().count("reloading digits failed, its loaded version serves")


def served_config(stack: Stack) -> dict[str, Any]:
    answer = httpx.get(f"{stack.url}/v2/models/digits/config")
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def assert_serving(stack: Stack, traffic: Traffic) -> None:
    """Ready, READY in the index, and answering: more requests counted from now on."""
    assert httpx.get(f"{stack.url}/v2/models/digits/ready").status_code == 200
    index = httpx.post(f"{stack.url}/v2/repository/index").json()
    assert [e["state"] for e in index if e["name"] == "digits"] == ["READY"]
    seen = traffic.total()
    wait_for(lambda: traffic.total() > seen + 20, 30, "more requests answered")


def test_failed_reloads_keep_the_loaded_version_and_a_reload_swaps(stack: Stack) -> None:
    url = f"{stack.url}/v2/repository/models/digits/load"
    with Traffic(stack) as traffic:
        wait_for(lambda: traffic.total() > 20, 30, "requests to be answered")
        before = served_config(stack)
        answer = httpx.post(url, json={"parameters": {"config": '"max_batch_size": {{16}}'}})
        assert answer.status_code == 400
        assert answer.json() == {"error": "failed to load model 'digits': digits: the load's "
                                          "config is not JSON"}

        answer = httpx.post(url, json={"parameters": {"config": CANNOT_LOAD}}, timeout=150)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error.startswith("failed to load model 'digits': ") and "model.py" in error
        assert served_config(stack) == before
        assert_serving(stack, traffic)

        with (grpcclient.InferenceServerClient(grpc_url(stack)) as grpc,
              pytest.raises(InferenceServerException) as caught):
            grpc.load_model("digits", config=CANNOT_LOAD)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "failed to load model 'digits'" in caught.value.message()
        assert_serving(stack, traffic)

        # A change of the repository hash, as another API process or an operator writes it.
        bad = json_config("digits", CANNOT_LOAD)
        at = time.time()
        stack.redis().hset(Keys(stack.prefix).repository(), "digits",
                           record_value("loaded", time.time(), bad))
        wait_for(lambda: failed_beat(stack, config_digest(bad), at), 60,
                 "the worker to report the hash's reload failed")
        wait_for(lambda: api_dropped(stack) == 1, 30, "the API to drop the hash's reload")
        assert served_config(stack) == before
        assert_serving(stack, traffic)
        answer = httpx.post(url, json={"parameters": {"config": CANNOT_LOAD}}, timeout=150)
        assert answer.status_code == 400, answer.text
        recorded = stack.redis().hget(Keys(stack.prefix).repository(), "digits")
        assert "config" not in json.loads(cast(bytes, recorded)), "what serves is recorded"

        batching = {**before["dynamic_batching"], "max_queue_delay_microseconds": 50}
        faster = {**before, "dynamic_batching": batching}
        answer = httpx.post(url, json={"parameters": {"config": json.dumps(faster)}},
                            timeout=150)
        assert answer.status_code == 200, answer.text
        swapped = served_config(stack)
        assert swapped["dynamic_batching"] == batching
        assert_serving(stack, traffic)

        # ``conveyor models load``: back to the folder's configuration, whose artifact is gone.
        artifact = stack.repository / "digits" / "model.pt"
        artifact.rename(artifact.with_suffix(".moved"))
        try:
            at = time.time()
            done = subprocess.run([sys.executable, "-m", "conveyor.cli", "models", "load",
                                   "digits"], env=stack.env, capture_output=True, text=True,
                                  timeout=60, check=False)
            assert done.returncode == 0, done.stderr
            wait_for(lambda: failed_beat(stack, "", at), 60,
                     "the worker to report the folder's reload failed")
            wait_for(lambda: api_dropped(stack) == 2, 30, "the API to drop the folder's reload")
            assert served_config(stack) == swapped
            assert_serving(stack, traffic)
        finally:
            artifact.with_suffix(".moved").rename(artifact)
    assert traffic.statuses == {"200": traffic.total()}, traffic.statuses
    assert traffic.total() > 100


class FakeProcess:
    """Stands in for an inference process: alive until stopped."""

    pid = 4242
    exitcode = 0

    def __init__(self) -> None:
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.alive = False

    kill = terminate

    def join(self, timeout: float | None = None) -> None:
        pass


def serving(slot: Slot) -> Slot:
    """The slot with a ready process, as its process reports it."""
    slot.process = cast(BaseProcess, FakeProcess())
    slot.shared = SharedState(multiprocessing.get_context("spawn"))
    slot.shared.state = ProcState.READY
    return slot


def test_a_reload_is_staged_beside_the_serving_slots(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Without processes: staged slots replace the serving ones once all are ready; a
    failed one is abandoned (never restarted) and the serving ones stay; the next load
    drops it."""
    shutil.copytree(TEST_MODELS / "echo", tmp_path / "echo")
    monkeypatch.delenv("CONVEYOR_MODELS", raising=False)
    supervisor = Supervisor(Settings(model_repository=tmp_path, redis_url="redis://127.0.0.1:1/0"))
    supervisor._add_slots(supervisor.models["echo"])
    [first] = [serving(s) for s in supervisor.slots]
    override = json_config("echo", json.dumps({"backend": "python"}))
    supervisor._apply_repository({b"echo": record_value("loaded", 1.0, override)})
    [staged] = [s for s in supervisor.slots if s.staged]
    assert staged.override == override and staged.name != first.name
    attach(supervisor)
    assert sorted(worker_info()) == ["conveyor_models", "conveyor_slot echo/cpu/0",
                                     "conveyor_slot echo/cpu/0 staged"]
    attach(None)
    assert supervisor.ready(), "a staged reload does not count for the worker's readiness"
    supervisor._settle("echo")
    assert not first.retired, "the staged slot is not ready yet"

    serving(staged)
    supervisor._settle("echo")
    assert first.retired and not staged.staged
    assert supervisor.models["echo"].max_batch_size == 0  # the override's

    supervisor._apply_repository({b"echo": record_value("loaded", 2.0)})
    [failing] = [s for s in supervisor.slots if s.staged]
    failing.failed, failing.reason = True, "echo: RuntimeError: boom"
    supervisor._settle("echo")
    assert not staged.retired and not failing.retired and failing.next_start == math.inf
    assert supervisor.models["echo"].max_batch_size == 0 and supervisor.ready()

    supervisor._apply_repository({b"echo": record_value("loaded", 3.0, override)})
    assert failing.retired and not staged.retired, "a load of what serves drops the failure"
