"""Async jobs through real Redis, a real API, inference worker and job worker (docs/jobs.md)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, cast

import httpx
import numpy as np
import pytest

from tests.conftest import Stack
from tests.jobs_stack import (
    add_job_worker,
    echo_and_picky,
    result,
    rows,
    status,
    submit,
    wait_done,
    watch,
)
from tests.procs import ROOT, RedisServer, wait_for


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """echo (20 ms a batch, logging what it runs) and picky (fails on negative rows)."""
    folder = tmp_path_factory.mktemp("jobs")
    stack = Stack(redis_server.url, echo_and_picky(folder), logdir, extra_env={
        "ECHO_LOG": str(folder / "executed.log"), "CONVEYOR_JOB_LEASE_S": "2",
        "CONVEYOR_HEARTBEAT_STALE_S": "2", "CONVEYOR_JOB_MAX_BYTES": str(1 << 20),
        "CONVEYOR_CALLBACK_HOSTS": "127.0.0.1"})
    stack.add_api()
    stack.add_worker()
    add_job_worker(stack)
    stack.wait_ready(timeout=90)
    yield stack
    stack.stop()


def executed_rows(stack: Stack) -> int:
    path = Path(stack.extra_env["ECHO_LOG"])
    return len(path.read_text().split()) if path.exists() else 0


def rows_waiting(stack: Stack) -> int:
    return int(stack.redis().get(f"{stack.prefix}:{{echo}}:rows") or 0)


def job_keys(stack: Stack, job_id: str) -> set[str]:
    return {k.decode().removeprefix(f"{stack.prefix}:job:{{{job_id}}}")
            for k in cast(list[bytes], stack.redis().keys(f"{stack.prefix}:job:{{{job_id}}}*"))}


def test_3000_rows_come_back_in_order_with_rising_progress(stack: Stack) -> None:
    x = rows(3000)
    started = time.monotonic()
    job_id = submit(stack, x)
    final, seen = watch(stack, job_id)
    took = time.monotonic() - started
    assert final["state"] == "SUCCEEDED", final
    assert final["progress"] == {"done": 3000, "total": 3000}
    assert seen == sorted(seen), "progress went backwards"
    assert len({d for d in seen if 0 < d < 3000}) >= 3, seen
    assert final["created_at"] <= final["started_at"] <= final["finished_at"]
    out = result(stack, job_id)
    np.testing.assert_array_equal(out["y"], x * 2)
    assert out["batch_rows"].shape == (3000, 1) and out["batch_rows"].max() <= 32
    print(f"3000-row job: {took:.2f}s, {3000 / took:.0f} rows/s")
    wait_for(lambda: rows_waiting(stack) == 0, 5, "the job's rows to be released")
    assert job_keys(stack, job_id) == {"", ":chunks"}  # record and result; nothing else
    assert stack.redis().ttl(f"{stack.prefix}:job:{{{job_id}}}") > 86_000


def test_binary_inputs_chosen_outputs_and_binary_result(stack: Stack) -> None:
    x = rows(100, start=5000)
    header = json.dumps({"model": "echo", "outputs": [{"name": "y"}],
                         "parameters": {"priority": 2},
                         "inputs": [{"name": "x", "datatype": "FP32", "shape": [100, 4],
                                     "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    response = httpx.post(f"{stack.url}/v1/jobs", content=header + x.tobytes(),
                          headers={"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert watch(stack, job_id)[0]["state"] == "SUCCEEDED"
    response = httpx.get(f"{stack.url}/v1/jobs/{job_id}/result",
                         params={"binary_data_output": "true"})
    length = int(response.headers["inference-header-content-length"])
    outputs = json.loads(response.content[:length])["outputs"]
    assert [o["name"] for o in outputs] == ["y"]
    assert outputs[0]["shape"] == [100, 4]
    y = np.frombuffer(response.content[length:], dtype=np.float32).reshape(100, 4)
    np.testing.assert_array_equal(y, x * 2)


@pytest.mark.parametrize(("body", "status_code", "needle"), [
    ({"model": "nope", "inputs": []}, 404, "unknown model"),
    ({"inputs": []}, 400, "'model'"),
    ({"model": "echo", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3],
                                   "data": [1, 2, 3]}]}, 400, "unexpected shape"),
    ({"model": "echo", "parameters": {"priority": 9},
      "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]},
     400, "priority"),
    ({"model": "echo", "parameters": {"callback_url": "ftp://x"},
      "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]},
     400, "callback_url"),
])
def test_bad_submissions_are_refused_before_anything_runs(stack: Stack, body: dict[str, Any],
                                                          status_code: int, needle: str) -> None:
    response = httpx.post(f"{stack.url}/v1/jobs", json=body)
    assert response.status_code == status_code, response.text
    assert needle in response.json()["error"]


def test_a_model_failure_fails_the_job_with_the_models_message(stack: Stack) -> None:
    x = rows(500)
    x[300, 0] = -5
    job_id = submit(stack, x, model="picky")
    final, _ = watch(stack, job_id)
    assert final["state"] == "FAILED", final
    assert "chunk 18 (rows 288..)" in final["error"] and "negative row [-5.0" in final["error"]
    assert final["progress"]["done"] < 500 and final["finished_at"]
    response = httpx.get(f"{stack.url}/v1/jobs/{job_id}/result")
    assert response.status_code == 409 and "negative row" in response.json()["error"]
    assert httpx.delete(f"{stack.url}/v1/jobs/{job_id}").status_code == 409
    wait_for(lambda: int(stack.redis().get(f"{stack.prefix}:{{picky}}:rows") or 0) == 0, 5,
             "the failed job's rows to be released")
    assert job_keys(stack, job_id) <= {"", ":replies"}  # late answers to chunks in flight
    assert stack.redis().ttl(f"{stack.prefix}:job:{{{job_id}}}:replies") <= 300  # expire


def test_bodies_over_the_size_limit_get_413(stack: Stack) -> None:
    x = rows(70_000)  # 1.1 MB of binary tensors; the stack allows 1 MiB
    header = json.dumps({"model": "echo", "inputs": [
        {"name": "x", "datatype": "FP32", "shape": list(x.shape),
         "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    response = httpx.post(f"{stack.url}/v1/jobs", content=header + x.tobytes(),
                          headers={"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 413
    assert "CONVEYOR_JOB_MAX_BYTES" in response.json()["error"]


def test_unknown_ids_404(stack: Stack) -> None:
    for job_id in (uuid.uuid4().hex, "not-a-job", "{x}"):
        for method, path in (("GET", ""), ("GET", "/result"), ("DELETE", "")):
            response = httpx.request(method, f"{stack.url}/v1/jobs/{job_id}{path}")
            assert response.status_code == 404, (method, path, response.text)
            assert "unknown job" in response.json()["error"]


def test_cancel_midway_stops_progress_and_withdraws_what_is_queued(stack: Stack) -> None:
    job_id = submit(stack, rows(6000))
    wait_done(stack, job_id, 500)
    assert httpx.get(f"{stack.url}/v1/jobs/{job_id}/result").status_code == 409
    response = httpx.delete(f"{stack.url}/v1/jobs/{job_id}")
    assert response.status_code == 200, response.text
    assert response.json()["state"] == "CANCELLED"
    at_cancel = response.json()["progress"]["done"]
    time.sleep(0.5)
    done, ran = status(stack, job_id)["progress"]["done"], executed_rows(stack)
    time.sleep(1.0)
    final = status(stack, job_id)
    assert final["state"] == "CANCELLED" and final["finished_at"]
    assert final["progress"]["done"] == done < 6000
    assert done - at_cancel <= 2 * 32  # at most the chunks already in flight
    assert executed_rows(stack) == ran, "the model still ran rows of the cancelled job"
    again = httpx.delete(f"{stack.url}/v1/jobs/{job_id}")
    assert again.status_code == 200 and again.json()["state"] == "CANCELLED"
    result_response = httpx.get(f"{stack.url}/v1/jobs/{job_id}/result")
    assert result_response.status_code == 409 and result_response.json()["state"] == "CANCELLED"
    wait_for(lambda: rows_waiting(stack) == 0, 5, "withdrawn rows to be released")
    assert not {":input", ":chunks", ":lease"} & job_keys(stack, job_id)


def test_interactive_latency_stays_low_while_a_large_job_runs(stack: Stack) -> None:
    x = rows(9000)
    job_id = submit(stack, x)
    wait_done(stack, job_id, 200)
    latencies: list[float] = []
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [7, 7, 7, 7]}],
            "parameters": {"priority": 1}}
    with httpx.Client(timeout=10) as client:
        while status(stack, job_id)["state"] == "RUNNING" and len(latencies) < 150:
            sent = time.perf_counter()
            response = client.post(f"{stack.url}/v2/models/echo/infer", json=body)
            latencies.append(time.perf_counter() - sent)
            assert response.status_code == 200, response.text
    done_during = status(stack, job_id)["progress"]["done"]
    final, _ = watch(stack, job_id)
    assert final["state"] == "SUCCEEDED"
    np.testing.assert_array_equal(result(stack, job_id)["y"], x * 2)
    median = statistics.median(latencies)
    print(f"interactive while a job ran: {len(latencies)} requests, median "
          f"{median * 1000:.1f} ms, p90 {np.percentile(latencies, 90) * 1000:.1f} ms; "
          f"job at {done_during}/9000 rows when they stopped")
    assert len(latencies) >= 20
    assert median < 0.2


def test_a_killed_inference_process_only_delays_the_job(stack: Stack) -> None:
    x = rows(3000, start=10_000)
    job_id = submit(stack, x)
    wait_done(stack, job_id, 600)
    beats = cast(dict[bytes, bytes], stack.redis().hgetall(f"{stack.prefix}:{{echo}}:workers"))
    [victim] = [json.loads(v)["pid"] for k, v in beats.items() if not k.endswith(b":slot")]
    os.kill(victim, signal.SIGKILL)
    final, seen = watch(stack, job_id, timeout=90)
    assert final["state"] == "SUCCEEDED", final
    assert seen == sorted(seen)
    np.testing.assert_array_equal(result(stack, job_id)["y"], x * 2)
    stack.wait_ready()


def test_a_killed_job_worker_loses_nothing_and_the_job_resumes(stack: Stack) -> None:
    x = rows(6000, start=20_000)
    before = executed_rows(stack)
    job_id = submit(stack, x)
    wait_done(stack, job_id, 1500)
    [old] = [p for p in stack.workers if p.name.startswith("jobs-")]
    os.killpg(old.pid, signal.SIGKILL)
    stopped_at = status(stack, job_id)["progress"]["done"]
    stack.workers.remove(old)
    old.stop()
    add_job_worker(stack)
    final, seen = watch(stack, job_id, timeout=90)
    assert final["state"] == "SUCCEEDED", final
    assert seen == sorted(seen) and seen[0] >= stopped_at, "progress went backwards"
    np.testing.assert_array_equal(result(stack, job_id)["y"], x * 2)
    rerun = executed_rows(stack) - before - 6000
    assert rerun <= 3 * 32, f"{rerun} rows ran twice: the job restarted, not resumed"


def test_a_stopped_job_worker_hands_its_job_over_at_once(stack: Stack) -> None:
    x = rows(6000, start=40_000)
    job_id = submit(stack, x)
    wait_done(stack, job_id, 1000)
    [old] = [p for p in stack.workers if p.name.startswith("jobs-")]
    stopping = time.monotonic()
    old.stop()  # SIGTERM: a warm shutdown, which would otherwise wait for the job to end
    assert time.monotonic() - stopping < 5
    assert status(stack, job_id)["state"] == "RUNNING"
    assert "handing the job over" in old.log()
    stack.workers.remove(old)
    add_job_worker(stack)
    final, seen = watch(stack, job_id, timeout=60)
    assert final["state"] == "SUCCEEDED" and seen == sorted(seen)
    np.testing.assert_array_equal(result(stack, job_id)["y"], x * 2)


class _Hooks(BaseHTTPRequestHandler):
    """Fails the first POST, accepts the rest; keeps the bodies."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        self.send_response(500 if len(self.bodies) == 1 else 200)
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


def test_callback_is_retried_until_it_is_taken(stack: Stack) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hooks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/done"
        job_id = submit(stack, rows(64), callback_url=url)
        wait_for(lambda: len(_Hooks.bodies) >= 2, 30, "the callback to be retried")
        time.sleep(0.5)
    finally:
        server.shutdown()
        server.server_close()
    assert len(_Hooks.bodies) == 2
    assert all(b["id"] == job_id and b["state"] == "SUCCEEDED" for b in _Hooks.bodies)
    assert _Hooks.bodies[0]["progress"] == {"done": 64, "total": 64}


def test_cli_submits_with_a_progress_bar_and_saves_the_result(stack: Stack,
                                                              tmp_path: Path) -> None:
    x = rows(2000, start=30_000)
    np.save(tmp_path / "rows.npy", x)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "conveyor.cli", "jobs", *args,
                               "--url", stack.url], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})

    done = cli("submit", str(tmp_path / "rows.npy"), "--model", "echo", "-o",
               str(tmp_path / "out.npz"))
    assert done.returncode == 0, done.stderr
    assert "2000/2000 rows 100% SUCCEEDED" in done.stderr
    assert json.loads(done.stdout)["state"] == "SUCCEEDED"
    with np.load(tmp_path / "out.npz") as saved:
        np.testing.assert_array_equal(saved["y"], x * 2)
    job_id = json.loads(done.stdout)["id"]
    shown = cli("status", job_id)
    assert shown.returncode == 0 and json.loads(shown.stdout)["progress"]["done"] == 2000
    refused = cli("cancel", job_id)
    assert refused.returncode == 1 and "409" in refused.stderr
    queued = cli("submit", str(tmp_path / "rows.npy"), "--model", "echo", "--no-wait")
    assert queued.returncode == 0, queued.stderr
    assert watch(stack, queued.stdout.strip())[0]["state"] == "SUCCEEDED"
    saved_json = cli("result", queued.stdout.strip(), "-o", str(tmp_path / "out.json"))
    assert saved_json.returncode == 0
    assert json.loads((tmp_path / "out.json").read_text())["outputs"][0]["shape"] == [2000, 4]
