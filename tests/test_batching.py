"""Batching behaviour through real Redis and workers: priorities, memory, shapes, padding."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import TEST_MODELS, Stack
from tests.procs import RedisServer, wait_for


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log = tmp_path_factory.mktemp("batching") / "executed.log"
    stack = Stack(redis_server.url, TEST_MODELS, logdir, extra_env={
        "ECHO_LOG": str(log), "CONVEYOR_MODELS": "ordered,oom,ragged,padded"})
    stack.add_api()
    stack.add_worker()
    stack.wait_ready(timeout=90)
    yield stack
    stack.stop()


def post(stack: Stack, model: str, name: str, array: np.ndarray, datatype: str,
         **parameters: object) -> httpx.Response:
    body = {"inputs": [{"name": name, "datatype": datatype, "shape": list(array.shape),
                        "data": array.ravel().tolist()}], "parameters": parameters}
    return httpx.post(f"{stack.url}/v2/models/{model}/infer", json=body, timeout=60)


def outputs(response: httpx.Response) -> dict[str, np.ndarray]:
    assert response.status_code == 200, response.text
    return {o["name"]: np.array(o["data"]).reshape(o["shape"])
            for o in response.json()["outputs"]}


def test_priority_one_overtakes_a_priority_three_backlog(stack: Stack) -> None:
    log = Path(stack.extra_env["ECHO_LOG"] + ".ordered")
    hold = Path(f"{log}.hold")
    # The model waits while the hold file exists, so the backlog cannot drain before the
    # urgent requests are queued, however slowly a busy host sends them (timed, `make test`
    # here once sent fewer than 20 of 48 before 24 batches of 100 ms had drained them).
    hold.touch()
    backlog = [float(v) for v in range(100, 148)]
    urgent = [1.0, 2.0]
    try:
        with ThreadPoolExecutor(len(backlog) + len(urgent)) as pool:
            done = [pool.submit(post, stack, "ordered", "x", np.array([[v]], np.float32),
                                "FP32", priority=3) for v in backlog]
            wait_for(lambda: stack.redis().xlen(f"{stack.prefix}:{{ordered}}:q:3") >= 40, 30,
                     "the backlog to queue up")
            done += [pool.submit(post, stack, "ordered", "x", np.array([[v]], np.float32),
                                 "FP32", priority=1) for v in urgent]
            wait_for(lambda: stack.redis().xlen(f"{stack.prefix}:{{ordered}}:q:1") >= 2, 30,
                     "the urgent requests to queue up")
            hold.unlink()
            assert all(f.result().status_code == 200 for f in done)
    finally:
        hold.unlink(missing_ok=True)
    order = [float(v) for v in log.read_text().split()]
    last_urgent = max(order.index(v) for v in urgent)
    # Ahead of all but the batch that was held (and one formed beside it, at most).
    assert last_urgent < 6, f"priority 1 waited behind the backlog: {order}"


def test_out_of_memory_above_n_rows_serves_everything_and_learns_the_cap(stack: Stack) -> None:
    fit = 5
    # One request larger than fits: bisected by rows, answered whole.
    big = outputs(post(stack, "oom", "x", np.arange(16, dtype=np.float32).reshape(8, 2), "FP32"))
    np.testing.assert_array_equal(big["y"], 3 * np.arange(16).reshape(8, 2))

    def one(i: int) -> httpx.Response:
        rows = 1 + i % 3
        return post(stack, "oom", "x", np.full((rows, 2), i, np.float32), "FP32")

    with ThreadPoolExecutor(24) as pool:
        responses = list(pool.map(one, range(120)))
    for i, response in enumerate(responses):
        out = outputs(response)
        np.testing.assert_array_equal(out["y"], np.full((1 + i % 3, 2), 3.0 * i))
        assert out["batch_rows"].max() <= fit
    stats = stack.redis().hgetall(f"{stack.prefix}:{{oom}}:stats")
    assert int(stats[b"oom_count"]) >= 1

    def caps() -> list[int]:
        beats = stack.redis().hgetall(f"{stack.prefix}:{{oom}}:workers").values()
        return [json.loads(v)["row_cap"] for v in beats if b"row_cap" in v]

    wait_for(lambda: bool(caps()) and max(caps()) <= fit, 5, "the learned cap to settle at or below N")


def test_a_row_out_of_memory_alone_fails_alone(stack: Stack) -> None:
    values = [-2.0, *range(1, 5)]
    with ThreadPoolExecutor(len(values)) as pool:
        responses = list(pool.map(
            lambda v: post(stack, "oom", "x", np.full((1, 2), v, np.float32), "FP32"), values))
    assert responses[0].status_code == 500
    assert "out of device memory on a single row" in responses[0].json()["error"]
    assert all(r.status_code == 200 for r in responses[1:])


def test_mixed_shapes_are_never_stacked(stack: Stack) -> None:
    widths = [2, 3, 5] * 8
    with ThreadPoolExecutor(len(widths)) as pool:
        responses = list(pool.map(
            lambda w: post(stack, "ragged", "tokens", np.full((1, w), w, np.int64), "INT64"),
            widths))
    batched = 0
    for width, response in zip(widths, responses, strict=True):
        out = outputs(response)
        assert out["batch_width"][0, 0] == width
        np.testing.assert_array_equal(out["doubled"], np.full((1, width), 2 * width))
        batched += out["batch_rows"][0, 0] > 1
    assert batched, "concurrent same-shape requests should have shared batches"


def test_padded_batches_unpad_correctly(stack: Stack) -> None:
    lengths = [1, 4, 2, 7, 3, 5] * 4
    barrier = threading.Barrier(len(lengths))

    def one(n: int) -> httpx.Response:
        barrier.wait()
        return post(stack, "padded", "tokens", np.arange(1, n + 1, dtype=np.int64)[None, :],
                    "INT64")

    with ThreadPoolExecutor(len(lengths)) as pool:
        responses = list(pool.map(one, lengths))
    shared = 0
    for n, response in zip(lengths, responses, strict=True):
        out = outputs(response)
        np.testing.assert_array_equal(out["doubled"], 2 * np.arange(1, n + 1)[None, :])
        shared += out["batch_width"][0, 0] > n
    assert shared, "ragged requests should have shared padded batches"


def test_batch_cost_parameter_is_validated(stack: Stack) -> None:
    response = post(stack, "ragged", "tokens", np.ones((1, 2), np.int64), "INT64", cost=-1)
    assert response.status_code == 400 and "parameters.cost" in response.json()["error"]
    assert post(stack, "ragged", "tokens", np.ones((1, 2), np.int64), "INT64",
                cost=3).status_code == 200


def test_metrics_explain_batching_decisions(stack: Stack) -> None:
    post(stack, "ragged", "tokens", np.ones((1, 2), np.int64), "INT64")
    post(stack, "oom", "x", np.zeros((8, 2), np.float32), "FP32")  # above what fits: an OOM

    def scraped() -> str:
        return httpx.get(f"{stack.url}/metrics").text

    row_cap = re.compile(r'conveyor_row_cap\{consumer="[^"]+",model="oom"\} [1-5]\.0')
    wait_for(lambda: row_cap.search(scraped()) is not None, 10,
             "the lowered row cap in the metrics (with the next heartbeat)")
    text = scraped()
    assert 'conveyor_policy_arrival_rate_rows_per_second{consumer=' in text
    assert re.search(r'conveyor_batches_total\{model="ragged",reason="\w+"\} [1-9]', text)
    assert 'conveyor_batch_wait_seconds_total{model="ragged"}' in text
    assert re.search(r'conveyor_batch_execution_seconds_count\{model="ragged"\} [1-9]', text)
    assert 'conveyor_oom_total{model="oom"}' in text
    assert 'conveyor_worker_restarts_total{model="ragged"} 0.0' in text
