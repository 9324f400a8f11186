"""Pipeline step 1: 8-bit pixels to floats in [0, 1], and the count of bright ones."""

from typing import Any

import numpy as np


class Model:
    def __init__(self, config: dict[str, Any], device: str) -> None:
        pass

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raw = inputs["raw"]
        bright = (raw > 128).sum(axis=1, keepdims=True).astype(np.int32)
        return {"pixels": raw.astype(np.float32) / 255.0, "bright": bright}
