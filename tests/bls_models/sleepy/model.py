"""Called model: ``y = 2x`` after ``delay_ms`` per batch."""

import time

import numpy as np


class Model:
    def __init__(self, config: dict, device: str) -> None:
        self.delay_s = float(config["parameters"]["delay_ms"]) / 1000.0

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(self.delay_s)
        return {"y": inputs["x"] * 2}
