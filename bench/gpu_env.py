"""The GPU benchmark's first phase: what it ran on (torch, the device, package versions and
the commit), so that a results file says which software and hardware its figures belong to.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torchvision", "numpy", "fastapi", "starlette", "uvicorn", "httptools",
            "uvloop", "pydantic", "pydantic-settings", "redis", "hiredis", "celery",
            "kombu", "orjson", "msgpack", "grpcio", "protobuf", "aiohttp", "httpx")


def environment(device: str) -> dict[str, Any]:
    """Python, torch, CUDA and cuDNN, the device (and nvidia-smi's view of it on CUDA), the
    package versions (None: not installed) and the commit."""
    import torch

    cudnn: Any = torch.backends.cudnn  # untyped
    info: dict[str, Any] = {
        "python": sys.version.split()[0], "executable": sys.executable,
        "cpus": os.cpu_count(), "platform": platform.platform(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": cudnn.version() if cudnn.is_available() else None,
        "cudnn_benchmark": cudnn.benchmark,
        "device": device,
        "commit": commit(),
    }
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count)
        with contextlib.suppress(Exception):
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
            info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info["packages"] = versions
    return info


def commit() -> str:
    """The commit this tree is (a snapshot's COMMIT file, else git), and whether it is dirty."""
    with contextlib.suppress(OSError):
        return (ROOT / "COMMIT").read_text().strip() + " (snapshot)"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    return "unknown"
