"""On the GPU, conveyor answers what the model computes: FP16 on the device against FP32 on
the CPU, the traced model and conveyor's backend against the eager model, and the whole
stack, one request or many batched together, against the model in this process."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from bench.gpu_models import (
    Exported,
    binary_request,
    classifier,
    compute_dtype,
    decode_logits,
    logits,
    relative_diff,
    seeded_images,
    small_cnn,
    tolerance,
)
from bench.gpu_stack import GpuStack, infer_logits

pytestmark = pytest.mark.gpu


def assert_close(got: Any, want: Any, device: str) -> None:
    assert relative_diff(got, want) <= tolerance(device), (got.shape, relative_diff(got, want))


def test_the_device_computes_in_fp16_what_the_cpu_computes_in_fp32(device: str,
                                                                   exported: Exported) -> None:
    import torch

    want = torch.float16 if device.startswith("cuda") else torch.float32
    assert compute_dtype(device) == want and exported.eager.mean.dtype == want
    images = seeded_images(4)
    on_cpu = logits(classifier(small_cnn(), "cpu"), images, "cpu")
    assert_close(logits(exported.eager, images, device), on_cpu, device)


def test_logits_are_finite(device: str, exported: Exported) -> None:
    import numpy as np

    assert np.isfinite(logits(exported.eager, seeded_images(8), device)).all()


def test_the_traced_model_matches_the_eager_one(device: str, exported: Exported) -> None:
    images = seeded_images(4)
    assert_close(logits(exported.traced, images, device), logits(exported.eager, images, device),
                 device)


def test_the_backend_matches_the_eager_model_one_row_and_batched(device: str,
                                                                 exported: Exported) -> None:
    """conveyor's backend without the serving stack: numpy in, copies both ways, numpy out."""
    from batching.repository_scan import load_model_config
    from workers.backends import load_model

    folder = exported.repo / exported.classifier
    loaded = load_model(load_model_config(folder), folder, device)
    images = seeded_images(8, seed=3)
    want = logits(exported.eager, images, device)
    assert_close(loaded.predict({"image": images[:1]})["logits"], want[:1], device)
    assert_close(loaded.predict({"image": images})["logits"], want, device)


@pytest.mark.parametrize("protocol", ["binary", "json"])
def test_the_stack_answers_what_the_model_computes(device: str, exported: Exported,
                                                   stack: GpuStack, protocol: str) -> None:
    image = seeded_images(1)
    got = infer_logits(stack.base, exported.classifier, image, protocol)
    assert_close(got, logits(exported.eager, image, device), device)


def test_concurrent_requests_run_batched_and_each_gets_its_own_answer(
        device: str, exported: Exported, stack: GpuStack) -> None:
    images = seeded_images(32, seed=5)
    want = logits(exported.eager, images, device)
    before = stack.stats(exported.classifier)
    url = f"{stack.base}/v2/models/{exported.classifier}/infer"
    answers = asyncio.run(_infer_at_once(url, images))
    after = stack.stats(exported.classifier)
    for row, got in enumerate(answers):
        assert_close(got, want[row:row + 1], device)
    rows = after.get("inference_count", 0) - before.get("inference_count", 0)
    batches = after.get("execution_count", 0) - before.get("execution_count", 0)
    assert rows == len(images) and 0 < batches < rows, (rows, batches)


async def _infer_at_once(url: str, images: Any) -> list[Any]:
    """Each image as its own binary request, all sent at once; the logits in order."""
    async def one(client: httpx.AsyncClient, image: Any) -> Any:
        body, headers = binary_request(image[None])
        response = await client.post(url, content=body, headers=headers)
        assert response.status_code == 200, response.text
        return decode_logits(response.content,
                             response.headers.get("Inference-Header-Content-Length"))

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(images)),
                                 timeout=120) as client:
        return list(await asyncio.gather(*(one(client, image) for image in images)))
