"""Test model: one batch at a time, slowly, logging each row's marker in execution order;
while the file ``$ECHO_LOG.ordered.hold`` exists, a batch waits before it runs."""

import os
import time

import numpy as np


class Model:
    def __init__(self, config: dict, device: str) -> None:
        self.log = os.environ.get("ECHO_LOG", os.devnull) + ".ordered"
        self.hold = self.log + ".hold"

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        while os.path.exists(self.hold):
            time.sleep(0.01)
        with open(self.log, "a") as f:
            f.writelines(f"{v:g}\n" for v in x[:, 0])
        time.sleep(0.1)
        return {"y": x}
