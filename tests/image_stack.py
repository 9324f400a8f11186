"""Shared pieces of the large-tensor stack tests (the tensor arena, inputs fetched, outputs
uploaded): models of one UINT8 input ``image`` in rows of :data:`ROW` bytes, their images,
and a worker killed with a batch of them in hand."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar, cast

import numpy as np
import redis

from batching.keys import GROUP
from tests.conftest import Stack
from tests.procs import Proc, wait_for

T = TypeVar("T")

ROW = 64 * 1024
"""Bytes of one input row: above the smallest tensor the arena takes or a reference
carries (32 KiB by default)."""


def image_model(returns: str) -> str:
    """The source of a model whose ``predict`` returns ``returns``, an expression of ``x``,
    the batch's ``image``."""
    return f'''\
import numpy as np


class Model:
    def __init__(self, config, device):
        pass

    def predict(self, inputs):
        x = inputs["image"]
        return {returns}
'''


def slowed(model: str) -> str:
    """``model``, one second a batch: time to kill its worker with a batch in hand."""
    return model.replace("    def predict(self, inputs):\n",
                         "    def predict(self, inputs):\n        __import__('time').sleep(1.0)\n")


def image_config(outputs: dict[str, tuple[str, int]]) -> str:
    """The ``config.yaml`` of an image model with ``outputs``, each name's datatype and
    the length of its rows."""
    lines = "".join(f"  - {{name: {name}, datatype: {datatype}, shape: [-1, {length}]}}\n"
                    for name, (datatype, length) in outputs.items())
    return f"""\
backend: python
max_batch_size: 8
inputs:
  - {{name: image, datatype: UINT8, shape: [-1, {ROW}]}}
outputs:
{lines}"""


def add_model(root: Path, name: str, model: str, config: str) -> Path:
    """``root``, a model repository, with the model ``name`` written into it."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(model)
    (folder / "config.yaml").write_text(config)
    return root


def random_images(count: int, seed: int) -> list[np.ndarray]:
    """``count`` random images of one row each."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (1, ROW), dtype=np.uint8) for _ in range(count)]


def pending(r: redis.Redis, stack: Stack) -> int:
    """Entries read from the stack's model streams and not yet acknowledged."""
    return sum(int(cast(dict[str, int], r.xpending(key, GROUP))["pending"])
               for key in r.scan_iter(match=f"{stack.prefix}:*:q:*", _type="stream"))


def across_a_killed_worker(stack: Stack, ask: Callable[[np.ndarray], T],
                           given: list[np.ndarray]) -> tuple[list[T], Proc]:
    """``ask`` about each of ``given`` at once, through ``stack`` (its API processes added),
    whose first worker is SIGKILLed once it holds a batch of them, and another started:
    the answers, in order, and that other worker."""
    first = stack.add_worker()
    stack.wait_ready()
    r = stack.redis()
    with ThreadPoolExecutor(len(given)) as pool:
        answers = [pool.submit(ask, image) for image in given]
        wait_for(lambda: pending(r, stack) > 0, 30, "the first worker to hold a batch")
        first.kill_group()  # SIGKILL with the batch in hand: nothing of it kept
        second = stack.add_worker()
        return [a.result(timeout=60) for a in answers], second
