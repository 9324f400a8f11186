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
from tests.image_stack import (
    ROW,
    across_a_killed_worker,
    add_model,
    image_config,
    image_model,
    random_images,
    slowed,
)
from tests.procs import free_port, wait_for

pytestmark = pytest.mark.integration

MODEL = image_model('{"copy": x.copy(), "total": x.sum(axis=1, dtype=np.int64).reshape(-1, 1)}')


def _repository(root: Path, model: str = MODEL) -> Path:
    """``mirror`` answers each image with itself; ``spill`` too, but declares half of it
    (what the API bounds its upload by)."""
    for name, out_row in (("mirror", ROW), ("spill", ROW // 2)):
        add_model(root, name, model, image_config({"copy": ("UINT8", out_row),
                                                   "total": ("INT64", 1)}))
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


def test_large_outputs_come_back_by_reference_each_its_own_input(
        make_stack: MakeStack, tmp_path: Path) -> None:
    grpc_port = free_port()
    stack = make_stack(_repository(tmp_path / "repo"), CONVEYOR_TENSOR_TRANSPORT="fetch",
                       CONVEYOR_TENSOR_ARENA_MB="0", CONVEYOR_GRPC_PORT=str(grpc_port))
    url = stack.add_api()
    worker = stack.add_worker()
    stack.wait_ready()
    r = stack.redis()
    images = random_images(48, seed=11)
    before = int(r.info("stats")["total_net_input_bytes"])
    with ThreadPoolExecutor(8) as pool:  # several in flight: batches of several uploaded at once
        copies = list(pool.map(lambda image: _copy(url, "mirror", image), images))
    read = int(r.info("stats")["total_net_input_bytes"]) - before
    assert copies == [image.tobytes() for image in images]
    sent = sum(image.nbytes for image in images)
    assert read < sent / 4, f"Redis read {read:,} bytes for {sent:,} in and as many out"

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    for image in random_images(4, seed=12):
        given = grpcclient.InferInput("image", list(image.shape), "UINT8")
        given.set_data_from_numpy(image)
        result = client.infer("mirror", [given], outputs=[grpcclient.InferRequestedOutput("copy"),
                                                          grpcclient.InferRequestedOutput("total")])
        copy, total = result.as_numpy("copy"), result.as_numpy("total")
        assert copy is not None and total is not None
        assert copy.tobytes() == image.tobytes() and int(total[0, 0]) == int(image.sum())
    client.close()

    # Uploads over their bound are refused: those outputs travel in the Redis replies.
    spilled = random_images(8, seed=13)
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
    stack = make_stack(_repository(tmp_path / "repo", slowed(MODEL)),
                       CONVEYOR_TENSOR_TRANSPORT="fetch", CONVEYOR_TENSOR_ARENA_MB="0",
                       CONVEYOR_HEARTBEAT_STALE_S="2")
    url = stack.add_api()
    given = random_images(3, seed=14)
    copies, second = across_a_killed_worker(stack, lambda image: _copy(url, "mirror", image),
                                            given)
    assert copies == [image.tobytes() for image in given]
    wait_for(lambda: "large outputs go to the API process at" in second.log(), 30,
             "the next worker to log its uploads")
