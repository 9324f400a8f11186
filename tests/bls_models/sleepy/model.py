"""Called model: ``y = 2x`` after ``delay_ms`` per batch."""

import time
from typing import Any

import numpy as np


class Model:
    def __init__(self, config: dict[str, Any], device: str) -> None:
        self.delay_s = float(config["parameters"]["delay_ms"]) / 1000.0

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(self.delay_s)
        return {"y": inputs["x"] * 2}
