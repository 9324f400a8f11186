"""Test model of Triton's "simple" shape: the sum and the difference of two INT32 inputs."""

import numpy as np


class Model:
    def __init__(self, config: dict, device: str) -> None:
        pass

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
