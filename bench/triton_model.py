"""A Triton Python backend model (``model.py``) running the benchmark model's ONNX export.

Not imported by the project: bench/triton.py copies it into the model repository it writes,
next to ``model.onnx``, and Triton's Python backend stub runs it with bench/.triton-venv's
onnxruntime. This is the plain Python backend: Triton forms the batch (dynamic batching) and
``execute`` runs it in one onnxruntime call in the stub process, with no second process.

The onnxruntime session has INTRA_OP_THREADS intra-op threads (the model config's
``intra_op_threads`` parameter) with spinning off, so idle threads leave the CPU to the server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """INPUT0 -> OUTPUT0, FP32, as conveyor serves the benchmark models."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(config["parameters"]["intra_op_threads"]["string_value"])
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        path = Path(args["model_repository"]) / args["model_version"] / "model.onnx"
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def execute(self, requests: list[Any]) -> list[Any]:
        """One onnxruntime call for the whole batch Triton formed, split back per request."""
        inputs = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        outputs = self.session.run(["OUTPUT0"], {"INPUT0": np.concatenate(inputs)})[0]
        ends = np.cumsum([len(x) for x in inputs])[:-1]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)])
                for y in np.split(outputs, ends)]
