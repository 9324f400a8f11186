"""A Triton-layout model repository, built for the tests: ``config.pbtxt`` files, version
folders, ONNX graphs exported from torch, and a Python-backend ``TritonPythonModel``.

- ``scale``: ONNX, ``max_batch_size: 8``, versions 1, 2 and 3 (version ``v`` multiplies
  ``INPUT0`` by ``v``), ``version_policy: latest 2`` (2 and 3 are served).
- ``reverse``: Python backend, ``max_batch_size: 0``, ``INPUT0`` FP32 [3] -> ``OUTPUT0`` its
  elements reversed, ``SIZE`` INT64 [1] the number of elements it was given.
- ``scalar``: Python backend, ``max_batch_size: 4``, ``INPUT0`` FP32 [1] reshaped to one
  scalar per row for the model, which returns ``OUTPUT0`` = 10 x it, reshaped back to [1].
- ``fixed``: an ONNX graph whose input is [1, 4] (a fixed first dim), no configuration.
- ``stateful``: a ``config.pbtxt`` asking for sequence batching (not supported).
- ``unsigned``: a TorchScript model with no configuration (no signature to serve).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

SCALE_PBTXT = """\
name: "scale"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { latest: { num_versions: 2 } }
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 500
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy { max_queue_size: 100 }  # rows waiting
}
instance_group [ { count: 1, kind: KIND_CPU } ]
"""

REVERSE_PBTXT = """\
name: "reverse"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 3 ] },
         { name: "SIZE" data_type: TYPE_INT64 dims: [ 1 ] } ]
parameters: { key: "offset" value: { string_value: "0.5" } }
"""

REVERSE_MODEL = '''\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.offset = float(config["parameters"]["offset"]["string_value"])
        out = pb_utils.get_output_config_by_name(config, "OUTPUT0")
        self.dtype = pb_utils.triton_string_to_numpy(out["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            given = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            reversed_ = (given[::-1] + self.offset).astype(self.dtype)
            size = np.array([given.size], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", reversed_), pb_utils.Tensor("SIZE", size)]))
        return responses
'''

SCALAR_PBTXT = """\
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ]
"""

SCALAR_MODEL = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            given = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if given.ndim != 1:
                raise pb_utils.TritonModelException(f"got shape {given.shape}")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", given * 10)]))
        return responses
'''

STATEFUL_PBTXT = """\
name: "stateful"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching { max_sequence_idle_microseconds: 5000000 }
"""


class Scale(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def export_onnx(module: torch.nn.Module, path: Path, dynamic_batch: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    axes = {"INPUT0": {0: "batch"}, "OUTPUT0": {0: "batch"}} if dynamic_batch else None
    with warnings.catch_warnings():  # the TorchScript exporter: the newer one needs onnxscript
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module, (torch.zeros(1, 4),), str(path), input_names=["INPUT0"],
                          output_names=["OUTPUT0"], dynamic_axes=axes, dynamo=False)


def build_triton_repository(root: Path) -> Path:
    scale = root / "scale"
    for version in (1, 2, 3):
        export_onnx(Scale(float(version)), scale / str(version) / "model.onnx")
    (scale / "config.pbtxt").write_text(SCALE_PBTXT)

    reverse = root / "reverse"
    (reverse / "1").mkdir(parents=True)
    (reverse / "config.pbtxt").write_text(REVERSE_PBTXT)
    (reverse / "1" / "model.py").write_text(REVERSE_MODEL)

    scalar = root / "scalar"
    (scalar / "1").mkdir(parents=True)
    (scalar / "config.pbtxt").write_text(SCALAR_PBTXT)
    (scalar / "1" / "model.py").write_text(SCALAR_MODEL)

    export_onnx(Scale(1.0), root / "fixed" / "1" / "model.onnx", dynamic_batch=False)

    export_onnx(Scale(1.0), root / "stateful" / "1" / "model.onnx")
    (root / "stateful" / "config.pbtxt").write_text(STATEFUL_PBTXT)

    (root / "unsigned").mkdir()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        torch.jit.script(Scale(2.0)).save(str(root / "unsigned" / "model.pt"))  # type: ignore[no-untyped-call]
    return root
