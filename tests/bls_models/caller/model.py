"""Calling model: runs its batch through another model from ``predict`` (batching/bls.py).

The batch's first value picks the model called: -1 ``sleepy``, -2 this model itself,
anything else ``twice``. ``parameters.mode`` "sync" makes one call (``y`` is the called
model's), "async" two at once (``y`` their sum); ``prio`` is ``twice``'s (0 otherwise).
"""

import asyncio
from typing import Any

import numpy as np

from batching.bls import async_infer, infer


class Model:
    def __init__(self, config: dict[str, Any], device: str) -> None:
        self.name = config["name"]
        self.mode = config["parameters"]["mode"]

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        target = {-1: "sleepy", -2: self.name}.get(int(x[0, 0]), "twice")
        if self.mode == "async":
            async def both() -> list[dict[str, np.ndarray]]:
                return list(await asyncio.gather(async_infer(target, {"x": x}),
                                                 async_infer(target, {"x": x})))

            first, second = asyncio.run(both())
            return {"y": first["y"] + second["y"], "prio": first["prio"]}
        out = infer(target, {"x": x})
        return {"y": out["y"], "prio": out.get("prio", np.zeros((x.shape[0], 1), np.int32))}
