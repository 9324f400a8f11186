"""Test model of Triton's "simple" shape: the sum and the difference of two INT32 inputs,
after ``parameters.delay_ms`` (0 unless the config says)."""

import time

import numpy as np


class Model:
    def __init__(self, config: dict, device: str) -> None:
        self.delay_s = float(config.get("parameters", {}).get("delay_ms", 0)) / 1000.0

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.delay_s:
            time.sleep(self.delay_s)
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
