"""Test model: tokens of any length. ``doubled`` keeps the token axis (cut back per request
when padded); ``batch_rows`` and ``batch_width`` say what the batch looked like."""

import time

import numpy as np


class Model:
    def __init__(self, config: dict, device: str) -> None:
        pass

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tokens = inputs["tokens"]
        time.sleep(0.02)
        rows = tokens.shape[0]
        return {"doubled": tokens * 2,
                "batch_rows": np.full((rows, 1), rows, np.int64),
                "batch_width": np.full((rows, 1), tokens.shape[1], np.int64)}
