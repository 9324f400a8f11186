"""Pipeline step 2: logits = x W for a fixed W (seed 3), after ``delay_ms`` per batch."""

import time
from typing import Any

import numpy as np

WEIGHTS = np.random.default_rng(3).normal(size=(64, 10)).astype(np.float32)


class Model:
    def __init__(self, config: dict[str, Any], device: str) -> None:
        self.delay_s = float(config["parameters"].get("delay_ms", 0)) / 1000.0

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return {"logits": inputs["x"] @ WEIGHTS}
