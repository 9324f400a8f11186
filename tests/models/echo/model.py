"""Test model: doubles ``x`` and reports, per row, how many rows its batch had.

If the environment names ECHO_LOG, the first column of every executed batch is appended
to that file (one value per line), so tests can see exactly which rows ran; while the
file ``$ECHO_LOG.hold`` exists, a batch waits before it runs (and before it is logged).
With ``parameters: {log_starts: 1}``, each row also goes to ``$ECHO_LOG.starts`` as the
wall-clock second its batch started and its value.
"""

import os
import time

import numpy as np


class Model:
    def __init__(self, config: dict, device: str) -> None:
        self.log = os.environ.get("ECHO_LOG")
        self.delay_s = float(config["parameters"].get("delay_ms", 0)) / 1000.0
        self.log_starts = bool(int(config["parameters"].get("log_starts", 0)))

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        if self.log:
            while os.path.exists(f"{self.log}.hold"):
                time.sleep(0.01)
            started = time.time()
            with open(self.log, "a") as f:
                f.writelines(f"{v:g}\n" for v in x[:, 0])
            if self.log_starts:
                with open(f"{self.log}.starts", "a") as f:
                    f.writelines(f"{started:.6f} {v:g}\n" for v in x[:, 0])
        if self.delay_s:
            time.sleep(self.delay_s)
        rows = np.full((x.shape[0], 1), x.shape[0], dtype=np.int64)
        return {"y": x * 2, "batch_rows": rows}
