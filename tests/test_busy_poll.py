"""Busy polling (CONVEYOR_BUSY_POLL_US): a lone request makes the API poll while it waits
and the inference process poll after the batch, each for the window only, then sleep.

A polling process is runnable (state R) even when other processes get the CPU, and a
sleeping one is not (state S), so the test samples process states rather than CPU time,
which a loaded machine would starve."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import cast

import httpx

from tests.conftest import TEST_MODELS, MakeStack

WINDOW_S = 0.8
MODEL_S = 2.0


def runnable_share(pid: int, start: float, end: float) -> float:
    """The share of samples between ``start`` and ``end`` (time.monotonic()) in which
    ``pid``'s main thread was runnable."""
    time.sleep(max(0.0, start - time.monotonic()))
    samples = []
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            samples.append(f.read().rsplit(")", 1)[1].split()[0] == "R")
        time.sleep(0.005)
    return sum(samples) / len(samples)


def test_a_lone_request_polls_for_the_window_then_sleeps(make_stack: MakeStack,
                                                         tmp_path: Path) -> None:
    shutil.copytree(TEST_MODELS / "slow", tmp_path / "slow")
    config = tmp_path / "slow" / "config.yaml"
    config.write_text(config.read_text().replace("delay_ms: 600", f"delay_ms: {MODEL_S * 1000:.0f}"))
    stack = make_stack(tmp_path, CONVEYOR_MODELS="slow",
                       CONVEYOR_BUSY_POLL_US=str(int(WINDOW_S * 1e6)))
    url = stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    beats = cast(dict[bytes, bytes], stack.redis().hgetall(f"{stack.prefix}:{{slow}}:workers"))
    inference_pid = next(json.loads(v)["pid"] for k, v in beats.items()
                         if not k.endswith(b":slot"))
    api_pid = stack.apis[0][0].pid
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}
    answered: list[float] = []

    def infer() -> None:
        assert httpx.post(f"{url}/v2/models/slow/infer", json=body, timeout=10).status_code == 200
        answered.append(time.monotonic())

    sent = time.monotonic()
    client = threading.Thread(target=infer)
    client.start()
    # The model sleeps 2 s; the API polls for the first 0.8 s of it, then sleeps. The
    # margins allow for a request that reaches the API late on a loaded machine.
    assert runnable_share(api_pid, sent + 0.2, sent + 0.6) > 0.5
    assert runnable_share(api_pid, sent + 1.3, sent + 1.7) < 0.3
    client.join()
    # After the batch the inference process polls for the window, then sleeps.
    done = answered[0]
    assert runnable_share(inference_pid, done + 0.05, done + 0.45) > 0.5
    assert runnable_share(inference_pid, done + 1.1, done + 1.5) < 0.3
