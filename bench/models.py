"""Seeded FP32 MLPs used by the benchmarks, and a model repository writer.

Usage: python -m bench.models OUT_DIR
"""

import itertools
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

# name -> layer widths, input first, output last
LAYERS: dict[str, list[int]] = {
    "mlp_tiny": [64, 256, 256, 10],
    "mlp_medium": [512, 2048, 2048, 2048, 512],
}

MAX_BATCH_SIZE = 64

CONFIG_TEMPLATE = """\
backend: torchscript
max_batch_size: {max_batch_size}
inputs:
  - {{name: INPUT0, datatype: FP32, shape: [-1, {n_in}]}}
outputs:
  - {{name: OUTPUT0, datatype: FP32, shape: [-1, {n_out}]}}
batching:
  max_queue_delay_us: 0
queue:
  max_queue_rows: 100000
instances:
  - {{device: cpu, count: 1}}
parameters:
  threads: 1
"""


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


def write_repository(root: Path) -> None:
    """Write `root/<name>/model.pt` (TorchScript) and `config.yaml` for every model."""
    for name, widths in LAYERS.items():
        model_dir = root / name
        model_dir.mkdir(parents=True, exist_ok=True)
        torch.jit.save(torch.jit.script(build(name)), str(model_dir / "model.pt"))
        config = CONFIG_TEMPLATE.format(max_batch_size=MAX_BATCH_SIZE, n_in=widths[0], n_out=widths[-1])
        (model_dir / "config.yaml").write_text(config)


def write_onnx(root: Path) -> None:
    """Write `root/<name>.onnx` for every model, batch dimension dynamic, named as conveyor serves
    it (INPUT0 -> OUTPUT0): what the Triton comparison (bench/triton.py) runs in onnxruntime."""
    root.mkdir(parents=True, exist_ok=True)
    for name, widths in LAYERS.items():
        with warnings.catch_warnings():  # the TorchScript exporter: the newer one needs onnxscript
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(build(name), (torch.zeros(1, widths[0]),), str(root / f"{name}.onnx"),
                              input_names=["INPUT0"], output_names=["OUTPUT0"],
                              dynamic_axes={"INPUT0": {0: "batch"}, "OUTPUT0": {0: "batch"}},
                              dynamo=False)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m bench.models OUT_DIR")
    write_repository(Path(sys.argv[1]))
