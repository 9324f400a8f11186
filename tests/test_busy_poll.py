"""Busy polling (CONVEYOR_BUSY_POLL_US): a lone request makes the API poll while it waits
and the inference process poll after the batch, each for the window only, then sleep."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx

from tests.conftest import Stack

WINDOW_S = 0.4
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def busy_s(pid: int, start: float, end: float) -> float:
    """CPU seconds ``pid`` uses between ``start`` and ``end`` (time.monotonic())."""
    time.sleep(max(0.0, start - time.monotonic()))
    before = cpu_s(pid)
    time.sleep(max(0.0, end - time.monotonic()))
    return cpu_s(pid) - before


def test_a_lone_request_polls_for_the_window_then_sleeps(make_stack: type[Stack]) -> None:
    stack = make_stack(CONVEYOR_MODELS="slow", CONVEYOR_BUSY_POLL_US=str(int(WINDOW_S * 1e6)))
    url = stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    beats = stack.redis().hgetall(f"{stack.prefix}:{{slow}}:workers")
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
    # The model sleeps 0.6 s; the API polls for the first 0.4 s of it.
    assert busy_s(api_pid, sent + 0.05, sent + 0.3) > 0.1
    assert busy_s(api_pid, sent + WINDOW_S + 0.05, sent + 0.55) < 0.05
    client.join()
    # After the batch the inference process polls for the window, then sleeps.
    done = answered[0]
    assert busy_s(inference_pid, done + 0.05, done + 0.3) > 0.1
    assert busy_s(inference_pid, done + WINDOW_S + 0.1, done + WINDOW_S + 0.4) < 0.05
