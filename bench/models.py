"""Seeded FP32 MLPs used by the benchmarks, exported to ONNX, and a model repository writer.

Every system in bench/run.py serves the same ONNX files in onnxruntime with the same
session options (:func:`session`): conveyor (a repository of ``model.onnx`` files, no
``config.yaml``: everything from the graph and the defaults), Triton, the plain wrapper and the
raw in-process model.

Usage: python -m bench.models OUT_DIR
"""

import itertools
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

# name -> layer widths, input first, output last
LAYERS: dict[str, list[int]] = {
    "mlp_tiny": [64, 256, 256, 10],
    "mlp_medium": [512, 2048, 2048, 2048, 512],
}

MAX_BATCH_SIZE = 64
"""conveyor's default ``max_batch_size``, which Triton's config gets too."""
INTRA_OP_THREADS = os.cpu_count() or 1
"""onnxruntime's intra-op threads everywhere: the machine's cores, as conveyor's default
``cpu_threads`` gives its one CPU instance."""


def build(name: str) -> nn.Module:
    """Return the seeded, eval-mode FP32 MLP called `name`."""
    widths = LAYERS[name]
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(widths):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).eval()


def input_width(name: str) -> int:
    return LAYERS[name][0]


def export_onnx(name: str, path: Path) -> None:
    """The model ``name`` as ONNX at ``path``, batch dimension dynamic, named as conveyor serves
    it (INPUT0 -> OUTPUT0)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # the TorchScript exporter: the newer one needs onnxscript
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(build(name), (torch.zeros(1, LAYERS[name][0]),), str(path),
                          input_names=["INPUT0"], output_names=["OUTPUT0"],
                          dynamic_axes={"INPUT0": {0: "batch"}, "OUTPUT0": {0: "batch"}},
                          dynamo=False)


def write_repository(root: Path) -> None:
    """``root/<name>/model.onnx`` for every model, with no ``config.yaml``."""
    for name in LAYERS:
        export_onnx(name, root / name / "model.onnx")


def session(path: Path) -> Any:
    """An onnxruntime session as every benchmarked system runs it: INTRA_OP_THREADS intra-op
    threads, one inter-op thread, idle threads not spinning."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = INTRA_OP_THREADS
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m bench.models OUT_DIR")
    write_repository(Path(sys.argv[1]))
