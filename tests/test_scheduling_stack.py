"""Scheduling through a real API, Redis and worker: priority aging under a saturating load."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.conftest import TEST_MODELS, Stack
from tests.procs import wait_for

SLOW_MODEL = TEST_MODELS / "slow" / "model.py"


def repository(root: Path, name: str, config: str) -> Path:
    """A model repository holding one copy of the ``slow`` test model under ``config``."""
    folder = root / name
    folder.mkdir(parents=True)
    shutil.copy(SLOW_MODEL, folder / "model.py")
    (folder / "config.yaml").write_text(config)
    return root


def infer(url: str, model: str, value: float, width: int = 4,
          **parameters: object) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, width],
                        "data": [value] * width}], "parameters": parameters}
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)


def test_saturating_priority_one_does_not_starve_priority_three(
        make_stack: Callable[..., Stack], tmp_path: Path) -> None:
    """Two rows per 100 ms batch, 16 closed-loop priority-1 clients: the device never
    idles and level 1 always has rows waiting. The priority-3 requests have another shape,
    so they never ride along in a priority-1 batch. Each still starts within
    max_priority_wait_ms plus the batch running when it aged (answered within that, its
    own batch and a generous margin for a busy host). Strict priority would hold them until
    the flood stops (it runs up to 20 s)."""
    wait_ms, batch_s = 800, 0.1
    stack = make_stack(repository(tmp_path / "models", "aging", f"""\
backend: python
max_batch_size: 2
inputs: [{{name: x, datatype: FP32, shape: [-1, -1]}}]
outputs:
  - {{name: y, datatype: FP32, shape: [-1, -1]}}
  - {{name: batch_rows, datatype: INT64, shape: [-1, 1]}}
batching: {{max_queue_delay_us: 0, adaptive: false}}
queue: {{max_priority_wait_ms: {wait_ms}}}
parameters: {{delay_ms: {int(batch_s * 1000)}}}
"""))
    stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    stop = threading.Event()
    flood_deadline = time.monotonic() + 20

    def flood() -> int:
        sent = 0
        while not stop.is_set() and time.monotonic() < flood_deadline:
            assert infer(stack.url, "aging", 1.0, priority=1).status_code == 200
            sent += 1
        return sent

    def low(value: float) -> float:
        began = time.monotonic()
        response = infer(stack.url, "aging", value, width=5, priority=3)
        assert response.status_code == 200, response.text
        return time.monotonic() - began

    with ThreadPoolExecutor(20) as pool:
        flooding = [pool.submit(flood) for _ in range(16)]
        wait_for(lambda: stack.redis().xlen(f"{stack.prefix}:{{aging}}:q:1") >= 6, 20,
                 "priority 1 to saturate the model")
        lows = []
        for i in range(3):
            lows.append(pool.submit(low, 30.0 + i))
            time.sleep(0.3)
        latencies = [f.result() for f in lows]
        still_flooding = time.monotonic() < flood_deadline
        stop.set()
        assert sum(f.result() for f in flooding) > 0
    assert still_flooding, "the flood ended before priority 3 was served: nothing was shown"
    bound_s = wait_ms / 1000 + 2 * batch_s
    assert max(latencies) < bound_s + 1.5, (latencies, bound_s)
