"""Scheduling through a real API, Redis and worker: priority aging under a saturating load,
and requests withdrawn when their clients leave."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.conftest import TEST_MODELS, Stack
from tests.procs import free_port, wait_for

SLOW_MODEL = TEST_MODELS / "slow" / "model.py"
ROOT = Path(__file__).resolve().parent.parent


def repository(root: Path, name: str, config: str) -> Path:
    """A model repository holding one copy of the ``slow`` test model under ``config``."""
    folder = root / name
    folder.mkdir(parents=True)
    shutil.copy(SLOW_MODEL, folder / "model.py")
    (folder / "config.yaml").write_text(config)
    return root


def infer(url: str, model: str, value: float, width: int = 4,
          **parameters: object) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, width],
                        "data": [value] * width}], "parameters": parameters}
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)


def test_saturating_priority_one_does_not_starve_priority_three(
        make_stack: Callable[..., Stack], tmp_path: Path) -> None:
    """Two rows per 100 ms batch, 16 closed-loop priority-1 clients: the device never
    idles and level 1 always has rows waiting. The priority-3 requests have another shape,
    so they never ride along in a priority-1 batch. Each still starts within
    max_priority_wait_ms plus the batch running when it aged. Counted in the batches that
    started between its admission (its stream entry's id says when) and its own start (the
    model logs when each batch started), the bound holds on a busy host too: a slow host
    runs fewer batches in that time, never more, and however late the client's request
    reaches the API, its wait starts there. Strict priority would hold them until the
    flood stops (it runs up to 20 s, some 200 batches)."""
    wait_ms, batch_s = 800, 0.1
    executed = tmp_path / "executed.log"
    stack = make_stack(repository(tmp_path / "models", "aging", f"""\
backend: python
max_batch_size: 2
inputs: [{{name: x, datatype: FP32, shape: [-1, -1]}}]
outputs:
  - {{name: y, datatype: FP32, shape: [-1, -1]}}
  - {{name: batch_rows, datatype: INT64, shape: [-1, 1]}}
batching: {{max_queue_delay_us: 0, adaptive: false}}
queue: {{max_priority_wait_ms: {wait_ms}}}
parameters: {{delay_ms: {int(batch_s * 1000)}, log_starts: 1}}
"""), ECHO_LOG=str(executed))
    stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    client = stack.redis()
    low_stream = f"{stack.prefix}:{{aging}}:q:3"
    stop = threading.Event()
    flood_deadline = time.monotonic() + 20

    def starts() -> list[tuple[float, str]]:
        """(when its batch started, value) of every row run so far, in order."""
        path = Path(f"{executed}.starts")
        lines = path.read_text().splitlines() if path.exists() else []
        return [(float(at), value) for at, value in (line.split() for line in lines)]

    def last_queued() -> tuple[int, float]:
        """How many priority-3 requests have entered their stream, and when the last one
        did (s since the epoch)."""
        if not client.exists(low_stream):
            return 0, 0.0
        info = client.xinfo_stream(low_stream)
        last_ms = int(info["last-generated-id"].decode().split("-")[0])
        return int(info["entries-added"]), last_ms / 1000.0

    def flood() -> int:
        sent = 0
        with httpx.Client(base_url=stack.url, timeout=60) as client:
            while not stop.is_set() and time.monotonic() < flood_deadline:
                body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                    "data": [1.0] * 4}], "parameters": {"priority": 1}}
                assert client.post("/v2/models/aging/infer", json=body).status_code == 200
                sent += 1
        return sent

    def low(value: float) -> None:
        response = infer(stack.url, "aging", value, width=5, priority=3)
        assert response.status_code == 200, response.text

    with ThreadPoolExecutor(20) as pool:
        flooding = [pool.submit(flood) for _ in range(16)]
        wait_for(lambda: client.xlen(f"{stack.prefix}:{{aging}}:q:1") >= 6, 20,
                 "priority 1 to saturate the model")
        lows, arrivals = [], []
        for i in range(3):
            lows.append(pool.submit(low, 30.0 + i))
            wait_for(lambda: last_queued()[0] == len(lows), 30, f"priority-3 request {i} queued")
            arrivals.append(last_queued()[1])
            # The next one arrives three batches later: they age at different moments.
            wait_for(lambda: sum(at >= arrivals[-1] for at, _ in starts()) >= 6, 30,
                     "three batches to start after it")
        for f in lows:
            f.result()
        still_flooding = time.monotonic() < flood_deadline
        stop.set()
        assert sum(f.result() for f in flooding) > 0
    assert still_flooding, "the flood ended before priority 3 was served: nothing was shown"
    run = starts()
    values = [value for _, value in run]
    ahead = [sum(at >= arrivals[i] for at, _ in run[:values.index(f"{30 + i}")])
             for i in range(3)]
    # Rows that started between a request's admission and its own start: the batches of
    # its wait and the one running when it aged, two rows each, and one more batch: the
    # first to start after its admission may have been formed before the worker read it.
    bound_rows = 2 * (round(wait_ms / 1000 / batch_s) + 2)
    assert max(ahead) <= bound_rows, (ahead, bound_rows)


def raw_infer(url: str, model: str, value: float) -> socket.socket:
    """Send an infer request on a connection of its own and leave it open, unread."""
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                   "data": [value] * 4}]}).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v2/models/%s/infer HTTP/1.1\r\nhost: x\r\ncontent-type: "
                 b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (model.encode(), len(body), body))
    return sock


def test_requests_whose_clients_left_are_withdrawn_and_never_run(
        make_stack: Callable[..., Stack], tmp_path: Path) -> None:
    """A fixed 3 s window holds what the worker read; a 600 ms model then runs it on the
    worker's own thread, reading nothing meanwhile. Clients leave at both moments: an HTTP
    client and a gRPC call whose requests the worker already holds (marked, dropped by the
    worker), and an HTTP client whose request waits unread in Redis (deleted at once)."""
    executed = tmp_path / "executed.log"
    grpc_port = free_port()
    stack = make_stack(repository(tmp_path / "models", "leaving", """\
backend: python
max_batch_size: 8
inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
outputs:
  - {name: y, datatype: FP32, shape: [-1, 4]}
  - {name: batch_rows, datatype: INT64, shape: [-1, 1]}
batching: {max_queue_delay_us: 3000000, adaptive: false}
parameters: {delay_ms: 600}
"""), ECHO_LOG=str(executed), CONVEYOR_GRPC_PORT=str(grpc_port))
    stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    client = stack.redis()
    stream, stats = f"{stack.prefix}:{{leaving}}:q:2", f"{stack.prefix}:{{leaving}}:stats"

    def delivered() -> int:
        return int(client.xpending(stream, "workers")["pending"])

    def withdrawn() -> int:
        return int(client.hget(stats, "withdrawn_count") or 0)

    # Read by the worker and held in its window, then the clients leave.
    held = raw_infer(stack.url, "leaving", 2.0)
    wait_for(lambda: delivered() == 1, 20, "the worker to read the HTTP request")
    with subprocess.Popen([sys.executable, "-m", "tests.grpc_cancel_probe",
                           f"127.0.0.1:{grpc_port}", "leaving", "3"], cwd=ROOT,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as probe:
        assert probe.stdout is not None and probe.stdin is not None
        assert probe.stdout.readline().strip() == "sent"
        wait_for(lambda: delivered() == 2, 20, "the worker to read the gRPC request")
        held.close()
        probe.stdin.write("cancel\n")
        probe.stdin.flush()
        assert probe.stdout.readline().strip() == "cancelled"
    wait_for(lambda: withdrawn() == 2 and delivered() == 0, 20,
             "the worker to drop both requests")
    assert not executed.exists()

    # The model runs one request; another waits unread in Redis, and its client leaves.
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(infer, stack.url, "leaving", 1.0)
        wait_for(lambda: executed.exists() and executed.read_text().split() == ["1"], 20,
                 "the model to start the first request")
        queued = raw_infer(stack.url, "leaving", 4.0)
        wait_for(lambda: client.xlen(stream) == 2, 20, "the second request to queue")
        queued.close()
        wait_for(lambda: withdrawn() == 3, 20, "the unread request to be withdrawn")
        assert running.result().status_code == 200
    assert executed.read_text().split() == ["1"]
    wait_for(lambda: client.xlen(stream) == 0 and int(client.get(
        f"{stack.prefix}:{{leaving}}:rows") or 0) == 0, 20, "the queue to empty")
    metrics = httpx.get(f"{stack.url}/metrics").text
    assert 'conveyor_withdrawn_total{model="leaving"} 3.0' in metrics, metrics
