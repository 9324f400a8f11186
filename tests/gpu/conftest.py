"""Fixtures of the GPU tests: the device, a model repository exported on it, and conveyor
serving that repository.

Every test skips without a CUDA device (``torch.cuda.is_available()``), and torch is
imported only when a test runs, not when pytest collects. ``CONVEYOR_GPU_TEST_DEVICE=cpu``
runs them on the CPU instead: a dry run of the tests themselves, in FP32, with the
out-of-memory error simulated.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bench.gpu_models import Exported, export_repository, small_cnn
from bench.gpu_stack import GpuStack

DEVICE_ENV = "CONVEYOR_GPU_TEST_DEVICE"
READY_TIMEOUT_S = 240.0


@pytest.fixture(scope="session")
def device() -> str:
    name = os.environ.get(DEVICE_ENV, "cuda:0")
    torch = pytest.importorskip("torch")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return name


@pytest.fixture(scope="session")
def exported(device: str, tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """The classifier (a small seeded CNN behind the uint8 wrapper), traced, and the
    out-of-memory model (batches above 8 rows do not fit), in one repository."""
    return export_repository(tmp_path_factory.mktemp("gpu-repo"), device, small_cnn(),
                             "classifier", max_batch=16, oom_rows=8)


@pytest.fixture(scope="session")
def stack(exported: Exported, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuStack]:
    """redis-server, the API and an inference worker serving the repository."""
    served = GpuStack(exported.repo, tmp_path_factory.mktemp("gpu-logs"))
    try:
        served.start(READY_TIMEOUT_S)
    except OSError:
        served.stop()
        raise
    yield served
    served.stop()
