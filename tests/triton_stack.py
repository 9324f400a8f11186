"""A stack serving stand-ins for Triton's QA models, for the tests that run tritonclient
the way Triton's own examples and QA tests do (tests/test_triton_*.py).

``simple`` is Triton's example model (two INT32 [-1, 16] inputs, their sum and
difference); ``simple_queue`` is the same with a 1 s model and room for one row in its
queue (Triton's ``max_queue_size: 1``); ``strings`` echoes BYTES [-1, -1]. The server
calls itself ``triton`` (``CONVEYOR_SERVER_NAME``), as drop-in deployments do.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tests.conftest import Stack
from tests.procs import RedisServer
from tests.protocol_stack import PROTOCOL_MODELS, grpc_url, http_host, protocol_stack

__all__ = ["ONES", "SERVER_NAME", "grpc_url", "http_url", "triton_stack"]

SERVER_NAME = "triton"
ONES = np.ones((1, 16), dtype=np.int32)
"""Triton's QA input for ``simple``."""


def build_repository(root: Path) -> Path:
    for name in ("simple", "strings"):
        shutil.copytree(PROTOCOL_MODELS / name, root / name)
    shutil.copytree(PROTOCOL_MODELS / "simple", root / "simple_queue")
    config = root / "simple_queue" / "config.yaml"
    config.write_text(config.read_text().replace("delay_ms: 0", "delay_ms: 1000")
                      + "queue:\n  max_queue_rows: 1\n")
    return root


def triton_stack(redis_server: RedisServer, logdir: Path, root: Path) -> Iterator[Stack]:
    return protocol_stack(redis_server, logdir, build_repository(root),
                          CONVEYOR_SERVER_NAME=SERVER_NAME)


http_url = http_host
