"""Large inputs skip Redis where the API process and the inference process share memory
(batching/tensor_arena.py): against a real redis-server, API process and Celery worker,
Redis reads a small part of the bytes the clients send, and every answer is right."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import MakeStack
from tests.image_stack import ROW, add_model, image_config, image_model, random_images

pytestmark = pytest.mark.integration

MODEL = image_model('{"total": x.reshape(x.shape[0], -1).sum(axis=1, dtype=np.int64).reshape(-1, 1)}')
CONFIG = image_config({"total": ("INT64", 1)})


def _repository(root: Path, model: str = MODEL) -> Path:
    return add_model(root, "summer", model, CONFIG)


def _infer(client: httpx.Client, url: str, image: np.ndarray) -> int:
    header = json.dumps({"inputs": [{"name": "image", "datatype": "UINT8", "shape": list(image.shape),
                                     "parameters": {"binary_data_size": image.nbytes}}]}).encode()
    response = client.post(f"{url}/v2/models/summer/infer", content=header + image.tobytes(),
                           headers={"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 200, response.text
    return int(response.json()["outputs"][0]["data"][0])


def test_large_inputs_pass_through_shared_memory_not_redis(make_stack: MakeStack,
                                                           tmp_path: Path) -> None:
    stack = make_stack(_repository(tmp_path / "repo"))
    url = stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    r = stack.redis()
    images = random_images(24, seed=3)
    with httpx.Client(timeout=30) as client:
        # The arena is made on the first large input, and used once the API process has
        # read the worker's heartbeat (a refresh a second): until a request skips Redis,
        # for a few seconds at most.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            before = int(r.info("stats")["total_net_input_bytes"])
            _infer(client, url, images[0])
            if int(r.info("stats")["total_net_input_bytes"]) - before < ROW // 2:
                break
            time.sleep(0.2)
        before = int(r.info("stats")["total_net_input_bytes"])
        totals = [_infer(client, url, image) for image in images]
        read = int(r.info("stats")["total_net_input_bytes"]) - before
    assert totals == [int(image.sum()) for image in images]
    sent = sum(image.nbytes for image in images)
    assert read < sent / 4, f"Redis read {read:,} bytes of {sent:,} sent"
