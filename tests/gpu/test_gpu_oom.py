"""A real CUDA out-of-memory error costs no request: the inference process halves the
batch until it fits, learns a row cap at or below what fits, and the other model on the
device goes on answering."""

from __future__ import annotations

import pytest

from bench.gpu_models import Exported, logits, relative_diff, seeded_images, tolerance
from bench.gpu_stack import GpuStack, infer_logits, oom_waves

pytestmark = pytest.mark.gpu


def test_out_of_memory_splits_batches_and_fails_no_request(device: str, exported: Exported,
                                                           stack: GpuStack) -> None:
    result = oom_waves(stack, waves=2, concurrency=32, limit_rows=exported.oom_rows,
                       simulated=not device.startswith("cuda"))
    assert result.passed, vars(result)
    assert result.dead_letter == 0, vars(result)
    image = seeded_images(1)
    answer = infer_logits(stack.base, exported.classifier, image, "binary")
    assert relative_diff(answer, logits(exported.eager, image, device)) <= tolerance(device)
    assert stack.heartbeats(exported.classifier)
