"""The bundled default model, through the official tritonclient, from 64 concurrent clients."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import MODELS, Stack
from tests.procs import RedisServer


def sample(metrics: str, pattern: str) -> float:
    """The value that ``pattern``'s group captures in the Prometheus text ``metrics``."""
    found = re.search(pattern, metrics)
    assert found is not None, pattern
    return float(found[1])


@pytest.fixture(scope="module")
def digits_stack(redis_server: RedisServer, logdir: Path) -> Iterator[Stack]:
    stack = Stack(redis_server.url, MODELS, logdir)
    stack.add_api()
    stack.add_worker()
    stack.wait_ready(timeout=90)
    yield stack
    stack.stop()


def test_tritonclient_64_concurrent_clients_get_correct_predictions(digits_stack: Stack) -> None:
    import tritonclient.http as httpclient

    holdout = np.load(MODELS / "digits" / "holdout.npz")
    x, y = holdout["X"].astype(np.float32), holdout["y"]
    host = digits_stack.url.removeprefix("http://")

    def client_run(c: int) -> list[tuple[int, int]]:
        client = httpclient.InferenceServerClient(host, network_timeout=60)
        answers = []
        for i in range(c, len(x), 64):
            inp = httpclient.InferInput("pixels", [1, 64], "FP32")
            inp.set_data_from_numpy(x[i:i + 1], binary_data=False)
            out = httpclient.InferRequestedOutput("probabilities", binary_data=False)
            result = client.infer("digits", [inp], outputs=[out])
            probs = result.as_numpy("probabilities")
            assert probs.shape == (1, 10)
            answers.append((i, int(probs.argmax())))
        client.close()
        return answers

    with ThreadPoolExecutor(64) as pool:
        answers = [a for chunk in pool.map(client_run, range(64)) for a in chunk]
    assert len(answers) == len(x)
    accuracy = np.mean([pred == y[i] for i, pred in answers])
    assert accuracy >= 0.95

    metrics = httpx.get(f"{digits_stack.url}/metrics").text
    total = sample(metrics, r'conveyor_request_batch_size_count\{model="digits"\} (\S+)')
    single = sample(metrics, r'conveyor_request_batch_size_bucket\{le="1.0",model="digits"\} (\S+)')
    assert total >= len(x)
    assert single < total, "no request ran in a batch larger than one"


def test_tritonclient_health_and_metadata(digits_stack: Stack) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(digits_stack.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits")
    meta = client.get_model_metadata("digits")
    assert meta["inputs"][0] == {"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}
    assert meta["outputs"][0]["name"] == "probabilities"
