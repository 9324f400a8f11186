"""The GPU benchmark's and GPU tests' models: an image classifier (uint8 NHWC in, FP32 logits
out, FP16 and channels_last on CUDA), the out-of-memory model, the model repository they
live in, and the KServe v2 request bodies that reach them.

torch, torchvision and numpy are imported inside the functions, so that importing this
module (as pytest does when it collects tests/gpu) needs none of them.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_SHAPE = (224, 224, 3)
CLASSES = 1000
OOM_MODEL_NAME = "oomtest"

CLASSIFIER_CONFIG = """\
backend: torchscript
max_batch_size: {max_batch}
inputs:
  - {{name: image, datatype: UINT8, shape: [-1, 224, 224, 3]}}
outputs:
  - {{name: logits, datatype: FP32, shape: [-1, 1000]}}
queue:
  max_queue_rows: 100000
instances:
  - {{device: "{device}", count: {instances}}}
"""

OOM_CONFIG = """\
backend: python
max_batch_size: 64
inputs:
  - {{name: x, datatype: FP32, shape: [-1, 4]}}
outputs:
  - {{name: y, datatype: FP32, shape: [-1, 4]}}
batching:
  adaptive: false
  max_queue_delay_us: 50000
instances:
  - {{device: "{device}", count: 1}}
parameters:
  oom_rows: {oom_rows}
"""

OOM_MODEL = '''\
"""Allocates on its device in proportion to the batch's rows: more than ``oom_rows`` rows
cannot fit in the memory free at that moment, so such a batch raises a real
torch.cuda.OutOfMemoryError (on a CPU the error is raised without allocating: a dry run)."""

import numpy as np
import torch


class Model:
    def __init__(self, config, device):
        self.device = torch.device(device)
        self.limit = int(config["parameters"]["oom_rows"])
        torch.zeros(1, device=self.device)  # create the context now, not in the first batch

    def predict(self, inputs):
        x = np.array(inputs["x"], dtype=np.float32)
        rows = x.shape[0]
        if self.device.type != "cuda":
            if rows > self.limit:
                raise torch.cuda.OutOfMemoryError(f"simulated: {rows} rows > {self.limit}")
            return {"y": x * 2}
        try:
            free, _total = torch.cuda.mem_get_info(self.device)
            per_row = int(free / (self.limit + 0.5))
            block = torch.empty(rows * per_row, dtype=torch.uint8, device=self.device)
            block[::1 << 20].fill_(1)  # touch it: one byte per MiB
            y = (torch.from_numpy(x).to(self.device) * 2).cpu().numpy()
            del block
            return {"y": y}
        finally:
            torch.cuda.empty_cache()  # give the memory back: the next batch measures free again
'''


def compute_dtype(device: str) -> Any:
    """FP16 on CUDA, FP32 elsewhere."""
    import torch

    return torch.float16 if device.startswith("cuda") else torch.float32


def resnet50() -> Any:
    """ResNet-50 (torchvision, no weights) seeded with 0: the benchmark's network."""
    import torch
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet50(weights=None)


def small_cnn() -> Any:
    """A small convolutional network seeded with 0, the same layer kinds as ResNet (conv,
    batch norm, ReLU, pooling, linear): the tests' network, quick on any device."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 7, stride=4, padding=3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, CLASSES))
    with torch.no_grad():  # batch norm statistics other than the identity
        for name, buffer in net.named_buffers():
            if name.endswith("running_mean"):
                buffer.uniform_(-0.1, 0.1)
            elif name.endswith("running_var"):
                buffer.uniform_(0.5, 1.5)
    return net


BENCH_MODEL = "resnet50"
"""The classifier's name in the benchmark's model repository."""
NETS = {"resnet50": ("ResNet-50", resnet50), "small": ("small CNN", small_cnn)}
"""The benchmark's --net: the network behind the classifier wrapper (the small one for a
quick dry run where torchvision is not installed), by its name in the report."""


def classifier(net: Any, device: str) -> Any:
    """``net`` behind a wrapper that takes uint8 NHWC images and normalises them on the
    device, in eval mode, in ``compute_dtype(device)``, channels_last."""
    import torch
    from torch import nn

    dtype = compute_dtype(device)

    class Classifier(nn.Module):
        mean: torch.Tensor
        inv_std: torch.Tensor

        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net
            mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
            std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
            self.register_buffer("mean", mean.to(dtype))
            self.register_buffer("inv_std", (1 / std).to(dtype))

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            # NHWC bytes -> NCHW view whose strides are already channels_last.
            x = image.permute(0, 3, 1, 2).to(self.mean.dtype)
            x = ((x - self.mean) * self.inv_std).contiguous(memory_format=torch.channels_last)
            return self.net(x).float()  # type: ignore[no-any-return]

    model: Any = Classifier(net.eval()).to(device=device, dtype=dtype)
    return model.to(memory_format=torch.channels_last).eval()


def seeded_images(rows: int, seed: int = 1) -> Any:
    """``rows`` random uint8 images (NHWC), the same for the same seed."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, size=(rows, *IMAGE_SHAPE), dtype=np.uint8)


def export_classifier(model: Any, folder: Path, device: str, max_batch: int,
                      instances: int = 1) -> Any:
    """Trace ``model`` into the model folder ``folder`` (torchscript backend on ``device``)
    and return the traced model as loaded back from the file."""
    import torch

    jit: Any = torch.jit  # untyped
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(CLASSIFIER_CONFIG.format(max_batch=max_batch, device=device,
                                                                 instances=instances))
    example = torch.from_numpy(seeded_images(2)).to(device)
    with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; conveyor still serves it
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
        with torch.inference_mode():
            traced = jit.trace(model, example, check_trace=False)
        jit.save(traced, str(folder / "model.pt"))
        return jit.load(str(folder / "model.pt"), map_location=device)


def write_oom_model(repo: Path, device: str, oom_rows: int) -> None:
    """``repo/oomtest``: a python model that runs out of memory above ``oom_rows`` rows."""
    folder = repo / OOM_MODEL_NAME
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(OOM_MODEL)
    (folder / "config.yaml").write_text(OOM_CONFIG.format(device=device, oom_rows=oom_rows))


@dataclass(frozen=True)
class Exported:
    """A repository ``export_repository`` wrote, and its classifier in this process."""

    repo: Path
    classifier: str
    """The classifier's model name (its folder)."""
    oom_rows: int
    """Batches of the out-of-memory model above this many rows run out of memory."""
    eager: Any
    traced: Any


def export_repository(repo: Path, device: str, net: Any, classifier_name: str, max_batch: int,
                      oom_rows: int, instances: int = 1) -> Exported:
    """``net`` as the classifier, traced, and the out-of-memory model, both on ``device``."""
    eager = classifier(net, device)
    traced = export_classifier(eager, repo / classifier_name, device, max_batch, instances)
    write_oom_model(repo, device, oom_rows)
    return Exported(repo, classifier_name, oom_rows, eager, traced)


def logits(model: Any, images: Any, device: str) -> Any:
    """``model``'s logits for the numpy ``images``, run on ``device``, back on the host."""
    import torch

    with torch.inference_mode():
        return model(torch.from_numpy(images).to(device)).cpu().numpy()


def relative_diff(got: Any, want: Any) -> float:
    """The largest difference between two sets of logits, relative to the largest logit."""
    import numpy as np

    if got.shape != want.shape:
        return float("inf")
    return float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))


def tolerance(device: str) -> float:
    """The most ``relative_diff`` two runs of the classifier may differ by: FP16 on CUDA
    (whose kernels differ between batch sizes), FP32 on a CPU."""
    return 2e-2 if device.startswith("cuda") else 1e-4


def binary_request(images: Any) -> tuple[bytes, dict[str, str]]:
    """A binary-tensor request for ``images`` that asks for binary logits back."""
    header = json.dumps({
        "inputs": [{"name": "image", "datatype": "UINT8", "shape": list(images.shape),
                    "parameters": {"binary_data_size": int(images.nbytes)}}],
        "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
    }).encode()
    return header + images.tobytes(), {"Inference-Header-Content-Length": str(len(header)),
                                       "Content-Type": "application/octet-stream"}


def json_request(images: Any) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"inputs": [{"name": "image", "datatype": "UINT8",
                                   "shape": list(images.shape),
                                   "data": images.reshape(-1).tolist()}]}).encode()
    return body, {"Content-Type": "application/json"}


def decode_logits(body: bytes, header_length: str | None) -> Any:
    """The logits of a reply: binary when it has an ``Inference-Header-Content-Length``."""
    import numpy as np

    if header_length is None:
        doc = json.loads(body)
        return np.asarray(doc["outputs"][0]["data"], dtype=np.float32).reshape(-1, CLASSES)
    length = int(header_length)
    return np.frombuffer(body[length:], dtype=np.float32).reshape(-1, CLASSES)
