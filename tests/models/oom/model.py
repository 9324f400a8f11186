"""Test model: raises torch's out-of-memory error for batches above ``parameters.rows_fit``
rows, and for any batch holding a row whose first value is -2 (a row too big alone)."""

import numpy as np
import torch


class Model:
    def __init__(self, config: dict, device: str) -> None:
        self.fit = int(config["parameters"]["rows_fit"])

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        if x.shape[0] > self.fit or (x[:, 0] == -2).any():
            raise torch.OutOfMemoryError(f"CUDA out of memory: {x.shape[0]} rows")
        return {"y": x * 3, "batch_rows": np.full((x.shape[0], 1), x.shape[0], np.int64)}
