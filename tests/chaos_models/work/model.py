"""Chaos-suite model: ``y = x + 1`` after ``delay_ms`` per batch. Rows with x[0] == -1 kill
the process (a poison request), as a segfaulting native library would."""

import os
import signal
import time

import numpy as np


class Model:
    def __init__(self, config: dict, device: str) -> None:
        self.delay_s = float(config["parameters"].get("delay_ms", 0)) / 1000.0

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        if (x[:, 0] == -1).any():
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.delay_s)
        return {"y": x + 1}
