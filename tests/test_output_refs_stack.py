"""Large outputs uploaded by the inference process to the API process's bytes endpoint, the
path between hosts forced on one (``CONVEYOR_TENSOR_TRANSPORT=fetch``), against a real
redis-server, an API process and a Celery worker: every output, over HTTP and gRPC, is its
own input's bytes, and neither the inputs nor the outputs pass through Redis; a model whose
outputs exceed what it declares has its uploads refused, and its outputs come back in the
Redis replies instead, still each request's own; the entries of a worker killed with a
batch in hand are run and uploaded by the next."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import MakeStack
from tests.procs import free_port, wait_for
from tests.test_tensor_fetch_stack import _pending

pytestmark = pytest.mark.integration

ROW = 64 * 1024
"""Bytes of one row, in and out: above the smallest tensor sent by reference (32 KiB)."""
MODEL = '''\
import numpy as np


class Model:
    def __init__(self, config, device):
        pass

    def predict(self, inputs):
        x = inputs["image"]
        return {"copy": x.copy(), "total": x.sum(axis=1, dtype=np.int64).reshape(-1, 1)}
'''


def _config(out_row: int) -> str:
    return f"""\
backend: python
max_batch_size: 8
inputs:
  - {{name: image, datatype: UINT8, shape: [-1, {ROW}]}}
outputs:
  - {{name: copy, datatype: UINT8, shape: [-1, {out_row}]}}
  - {{name: total, datatype: INT64, shape: [-1, 1]}}
"""


def _repository(root: Path, model: str = MODEL) -> Path:
    """``mirror`` answers each image with itself; ``spill`` too, but declares half of it
    (what the API bounds its upload by)."""
    for name, out_row in (("mirror", ROW), ("spill", ROW // 2)):
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "model.py").write_text(model)
        (folder / "config.yaml").write_text(_config(out_row))
    return root


def _copy(url: str, model: str, image: np.ndarray) -> bytes:
    """The ``copy`` output of one binary request, as binary."""
    header = json.dumps({
        "inputs": [{"name": "image", "datatype": "UINT8", "shape": list(image.shape),
                    "parameters": {"binary_data_size": image.nbytes}}],
        "outputs": [{"name": "copy", "parameters": {"binary_data": True}}]}).encode()
    response = httpx.post(f"{url}/v2/models/{model}/infer", content=header + image.tobytes(),
                          headers={"Inference-Header-Content-Length": str(len(header))},
                          timeout=60)
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    described = json.loads(response.content[:length])["outputs"]
    assert [o["name"] for o in described] == ["copy"]
    assert described[0]["shape"] == list(image.shape)
    return response.content[length:]


def _images(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (1, ROW), dtype=np.uint8) for _ in range(count)]


def test_large_outputs_come_back_by_reference_each_its_own_input(
        make_stack: MakeStack, tmp_path: Path) -> None:
    grpc_port = free_port()
    stack = make_stack(_repository(tmp_path / "repo"), CONVEYOR_TENSOR_TRANSPORT="fetch",
                       CONVEYOR_TENSOR_ARENA_MB="0", CONVEYOR_GRPC_PORT=str(grpc_port))
    url = stack.add_api()
    worker = stack.add_worker()
    stack.wait_ready()
    r = stack.redis()
    images = _images(48, seed=11)
    before = int(r.info("stats")["total_net_input_bytes"])
    with ThreadPoolExecutor(8) as pool:  # several in flight: batches of several uploaded at once
        copies = list(pool.map(lambda image: _copy(url, "mirror", image), images))
    read = int(r.info("stats")["total_net_input_bytes"]) - before
    assert copies == [image.tobytes() for image in images]
    sent = sum(image.nbytes for image in images)
    assert read < sent / 4, f"Redis read {read:,} bytes for {sent:,} in and as many out"

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    for image in _images(4, seed=12):
        given = grpcclient.InferInput("image", list(image.shape), "UINT8")
        given.set_data_from_numpy(image)
        result = client.infer("mirror", [given], outputs=[grpcclient.InferRequestedOutput("copy"),
                                                          grpcclient.InferRequestedOutput("total")])
        copy, total = result.as_numpy("copy"), result.as_numpy("total")
        assert copy is not None and total is not None
        assert copy.tobytes() == image.tobytes() and int(total[0, 0]) == int(image.sum())
    client.close()

    # Uploads over their bound are refused: those outputs travel in the Redis replies.
    spilled = _images(8, seed=13)
    before = int(r.info("stats")["total_net_input_bytes"])
    with ThreadPoolExecutor(4) as pool:
        copies = list(pool.map(lambda image: _copy(url, "spill", image), spilled))
    read = int(r.info("stats")["total_net_input_bytes"]) - before
    assert copies == [image.tobytes() for image in spilled]
    assert read >= sum(image.nbytes for image in spilled)
    wait_for(lambda: "declared outputs hold were refused" in worker.log(), 30,
             "the worker to log the refused uploads")


def test_a_killed_worker_s_batch_is_run_and_uploaded_by_the_next(
        make_stack: MakeStack, tmp_path: Path) -> None:
    slow = MODEL.replace("    def predict(self, inputs):\n",
                         "    def predict(self, inputs):\n        __import__('time').sleep(1.0)\n")
    stack = make_stack(_repository(tmp_path / "repo", slow), CONVEYOR_TENSOR_TRANSPORT="fetch",
                       CONVEYOR_TENSOR_ARENA_MB="0", CONVEYOR_HEARTBEAT_STALE_S="2")
    url = stack.add_api()
    first = stack.add_worker()
    stack.wait_ready()
    r = stack.redis()
    images = _images(3, seed=14)
    with ThreadPoolExecutor(len(images)) as pool:
        answers = [pool.submit(_copy, url, "mirror", image) for image in images]
        wait_for(lambda: _pending(r, stack) > 0, 30, "the first worker to hold a batch")
        first.kill_group()  # SIGKILL with the batch in hand: nothing of it uploaded
        second = stack.add_worker()
        assert [a.result(timeout=60) for a in answers] == [image.tobytes() for image in images]
    wait_for(lambda: "large outputs go to the API process at" in second.log(), 30,
             "the next worker to log its uploads")
