"""Test model: one batch at a time, slowly, logging each row's marker in execution order."""

import os
import time

import numpy as np


class Model:
    def __init__(self, config: dict, device: str) -> None:
        self.log = os.environ.get("ECHO_LOG", os.devnull) + ".ordered"

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        with open(self.log, "a") as f:
            f.writelines(f"{v:g}\n" for v in x[:, 0])
        time.sleep(0.1)
        return {"y": x}
