"""Several API processes on one port (``CONVEYOR_API_WORKERS``, api/process_pool.py).

The supervisor alone, over a stand-in ``serve`` (no Redis): it keeps its count when a child
dies, stops on a failed start, passes SIGTERM on, and its children die with it. Then the
real API with two processes: HTTP and gRPC on shared ports, every reply reaching the process
that asked, and one process killed costing nothing to the requests that follow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as grpcclient

from tests.conftest import MakeStack
from tests.procs import ROOT, free_port, wait_for

POOL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import api.process_pool as pool

    pool.RESTART_START_S = 0.05
    mode, out = sys.argv[1], sys.argv[2]

    def serve() -> int:
        open(os.path.join(out, str(os.getpid())), "w").close()
        if mode == "fail":
            return 3  # uvicorn's STARTUP_FAILURE
        time.sleep(120)
        return 0

    sys.exit(pool.ProcessPool(2, serve).run())
""")


def start_pool(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / "children"
    out.mkdir()
    script = tmp_path / "pool.py"
    script.write_text(POOL_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), mode, str(out)], cwd=ROOT)
    return proc, out


def children_of(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_pool_restarts_a_dead_child_and_passes_sigterm_on(tmp_path: Path) -> None:
    proc, out = start_pool(tmp_path, "serve")
    try:
        # Both running serve() (each has written its file): a child killed before it got
        # there would never write one, and the count below would wait for it in vain.
        wait_for(lambda: len(children_of(proc.pid)) == 2 and len(list(out.iterdir())) == 2,
                 20, "two children started")
        first = children_of(proc.pid)
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(children_of(proc.pid) - first) == 1, 20, "a replacement child")
        now = children_of(proc.pid)
        assert victim not in now and len(now) == 2
        # two started, one restarted (which writes its file once it runs: wait for it)
        wait_for(lambda: len(list(out.iterdir())) == 3, 20, "the replacement's start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        wait_for(lambda: all(gone(pid) for pid in now), 10, "the children to exit")
    finally:
        proc.kill()
        proc.wait()


def test_pool_stops_when_a_child_cannot_start(tmp_path: Path) -> None:
    proc, out = start_pool(tmp_path, "fail")
    try:
        assert proc.wait(20) == 3
        assert 1 <= len(list(out.iterdir())) <= 2  # never restarted
    finally:
        proc.kill()
        proc.wait()


def test_pool_children_die_with_the_supervisor(tmp_path: Path) -> None:
    proc, _ = start_pool(tmp_path, "serve")
    try:
        wait_for(lambda: len(children_of(proc.pid)) == 2, 20, "two children")
        kids = children_of(proc.pid)
        proc.kill()
        proc.wait()
        wait_for(lambda: all(gone(pid) for pid in kids), 10, "the orphans to exit")
    finally:
        proc.kill()


def infer_http(url: str) -> float:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                        "data": [1.0, 2.0, 3.0, 4.0]}]}
    with httpx.Client() as client:  # a new connection each time: the kernel picks the process
        response = client.post(f"{url}/v2/models/echo/infer", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return float(sum(next(o["data"] for o in response.json()["outputs"] if o["name"] == "y")))


def http_json_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"connection": "close"}).text
    line = next(ln for ln in text.splitlines()
                if ln.startswith('conveyor_protocol_requests_total{protocol="http_json"}'))
    return float(line.split()[-1])


def test_two_api_processes_share_both_ports(make_stack: MakeStack) -> None:
    grpc_port = free_port()
    stack = make_stack(CONVEYOR_API_WORKERS="2", CONVEYOR_GRPC_PORT=str(grpc_port))
    url = stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    api = stack.apis[0][0]
    wait_for(lambda: len(children_of(api.pid)) == 2, 30, "two API processes")
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda _: infer_http(url), range(40))) == [20.0] * 40
    # A scrape reaches one process and counts them all (their shared multiprocess folder).
    assert [http_json_requests(url) for _ in range(4)] == [40.0] * 4
    with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
        tensor = grpcclient.InferInput("x", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        result = client.infer("echo", [tensor]).as_numpy("y")
    assert result is not None and result.tolist() == [[2.0, 2.0, 2.0, 2.0]]
    # One process killed outright: the other serves every request that follows, and the
    # supervisor starts a replacement.
    before = children_of(api.pid)
    os.kill(min(before), signal.SIGKILL)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        assert infer_http(url) == 20.0
    wait_for(lambda: len(children_of(api.pid) - before) == 1, 30, "a replacement API process")
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda _: infer_http(url), range(20))) == [20.0] * 20
