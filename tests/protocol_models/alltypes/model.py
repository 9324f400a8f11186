"""Test model: every ``IN_<T>`` comes back unchanged as ``OUT_<T>`` (one per KServe datatype)."""

import numpy as np


class Model:
    def __init__(self, config: dict, device: str) -> None:
        self.names = [spec["name"] for spec in config["inputs"]]

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"OUT_" + name.removeprefix("IN_"): inputs[name] for name in self.names}
