"""A model that stands for a device: each batch of ``n`` rows takes ``A_S + B_S·n`` and no
CPU (it sleeps, as a process waits on a GPU), so the API, Redis and the generator keep the
cores. The batching sweep and its short version in CI serve it beside the MLPs, whose
model time competes with the API for the two cores of a small host: past capacity there
the API process, not the batching policy, decides the goodput.

A full batch (``MAX_BATCH_SIZE`` rows) takes 16 ms, about 1,000 rows a second; a request
that waits a whole batch and then runs in the next is answered in 32 ms, within a 50 ms
target.
"""

from __future__ import annotations

from pathlib import Path

NAME = "device"
A_S, B_S = 0.008, 0.0005
MAX_BATCH_SIZE = 16


def model_py(a_s: float = A_S, b_s: float = B_S) -> str:
    """The model's ``model.py``: a batch of ``n`` rows sleeps ``a_s + b_s·n``."""
    return f'''"""{NAME}: sleeps {a_s * 1e3:g} ms + {b_s * 1e3:g} ms a row (bench/device_model.py)."""
import time


class Model:
    def __init__(self, config, device):
        pass

    def predict(self, inputs):
        x = inputs["x"]
        time.sleep({a_s} + {b_s} * x.shape[0])
        return {{"y": x}}
'''


CONFIG = (f"backend: python\nmax_batch_size: {MAX_BATCH_SIZE}\n"
          "inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]\n"
          "outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]\n")
"""Its ``config.yaml``, but for the ``batching`` section each stack adds."""


def write(root: Path, a_s: float = A_S, b_s: float = B_S) -> None:
    """``root/device/model.py`` (:func:`model_py`); its config.yaml is :data:`CONFIG` plus a
    batching section."""
    (root / NAME).mkdir(parents=True, exist_ok=True)
    (root / NAME / "model.py").write_text(model_py(a_s, b_s))


def request_body() -> dict[str, object]:
    """One row, as the sweep sends it."""
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                        "data": [0.5, 1.0, 1.5, 2.0]}]}
