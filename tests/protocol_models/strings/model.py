"""Test model: ``OUTPUT0`` is ``INPUT0``, element for element."""

import numpy as np


class Model:
    def __init__(self, config: dict, device: str) -> None:
        pass

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"OUTPUT0": inputs["INPUT0"]}
