"""Test model, Triton's "simple": the sum and the difference of two INT32 inputs, after
``parameters.delay_ms`` (a model whose queue fills, or one slow enough to unregister a
shared memory region while it runs)."""

import time

import numpy as np


class Model:
    def __init__(self, config: dict, device: str) -> None:
        self.delay_s = float(config["parameters"].get("delay_ms", 0)) / 1000.0

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.delay_s:
            time.sleep(self.delay_s)
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
