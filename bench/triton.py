"""NVIDIA Triton for bench/run.py's comparison: its own virtual environment and two ways to serve.

Triton comes from the ``nvidia-pytriton`` wheel, which bundles the tritonserver binary, its
Python backend and the backend's stub for each Python version. It is a benchmark-only
dependency, so it lives in its own venv, bench/.triton-venv, created on first use: its packages
(numpy 1.x, protobuf, tritonclient) need not agree with the project's. Both ways run the models'
ONNX exports (bench/models.py) in onnxruntime, with dynamic batching:

- the plain Python backend (PYTHON_BACKEND): tritonserver on a model repository written here,
  whose ``model.py`` (bench/triton_model.py) runs onnxruntime inside the backend's stub process;
- pytriton (PYTRITON): bench/triton_server.py binds a ``@batch`` function; the stub forwards
  each batch to that Python process, one more hop per batch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import models

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "bench" / ".triton-venv"
REQUIREMENTS = ("nvidia-pytriton==0.7.0", "onnxruntime==1.32.0")
"""nvidia-pytriton 0.7.0 bundles Triton 2.51, the release the targets were set against."""
MARKER = VENV / ".installed"
"""Holds REQUIREMENTS once they installed; other contents (or none) mean install again."""
PYTHON_BACKEND = "Triton (python backend, onnxruntime)"
PYTRITON = "Triton (pytriton, python backend, onnxruntime)"
"""The rows' system names in bench/RESULTS.md."""
MAX_QUEUE_DELAY_US = 200
INTRA_OP_THREADS = models.INTRA_OP_THREADS

CONFIG_PBTXT = """\
backend: "python"
max_batch_size: {max_batch_size}
input [{{ name: "INPUT0", data_type: TYPE_FP32, dims: [{n_in}] }}]
output [{{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [{n_out}] }}]
dynamic_batching {{ max_queue_delay_microseconds: {delay_us}{queue_policy} }}
instance_group [{{ kind: KIND_CPU, count: 1 }}]
parameters {{ key: "intra_op_threads", value: {{ string_value: "{threads}" }} }}
"""


class VenvError(RuntimeError):
    """bench/.triton-venv could not be created; the message says which step failed and why."""


@dataclass(frozen=True)
class TritonVenv:
    """Where bench/.triton-venv keeps what the servers need."""

    python: Path
    site_packages: Path
    libdir: str
    """The interpreter's libpython directory: the stub links libpython3.x dynamically and
    loads this interpreter's standard library, so it must find this one before the
    distribution's (Debian's 3.11.2 under a pyenv 3.11.7 standard library fails to start)."""
    version: str
    """``3.11``: which of the wheel's stubs to use."""

    @property
    def dist(self) -> Path:
        return self.site_packages / "pytriton" / "tritonserver"


def ensure_venv() -> TritonVenv:
    """bench/.triton-venv, created and REQUIREMENTS installed first if needed."""
    python = VENV / "bin" / "python"
    wanted = "\n".join(REQUIREMENTS)
    if not (python.exists() and MARKER.exists() and MARKER.read_text() == wanted):
        steps = [[sys.executable, "-m", "venv", "--clear", str(VENV)],
                 [str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"],
                 [str(python), "-m", "pip", "install", "-q", *REQUIREMENTS]]
        print(f"creating {VENV.relative_to(ROOT)} ({', '.join(REQUIREMENTS)})", file=sys.stderr, flush=True)
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode:
                raise VenvError(f"`{' '.join(argv)}` failed ({done.returncode}): "
                                f"{(done.stderr or done.stdout).strip()[-1000:]}")
        MARKER.write_text(wanted)
    query = ("import json, sys, sysconfig; print(json.dumps([sysconfig.get_paths()['purelib'], "
             "sysconfig.get_config_var('LIBDIR') or '', '%d.%d' % sys.version_info[:2]]))")
    purelib, libdir, version = json.loads(subprocess.run([str(python), "-c", query], capture_output=True,
                                                         text=True, check=True).stdout)
    return TritonVenv(python, Path(purelib), libdir, version)


def pytriton_argv(venv: TritonVenv, onnx_dir: Path, model: str, http_port: int, grpc_port: int,
                  metrics_port: int, max_batch_size: int) -> list[str]:
    """bench/triton_server.py serving ``model`` from ``onnx_dir``/<model>/model.onnx on these ports."""
    return [str(venv.python), str(ROOT / "bench" / "triton_server.py"), "--onnx-dir", str(onnx_dir),
            "--model", model, "--http-port", str(http_port), "--grpc-port", str(grpc_port),
            "--metrics-port", str(metrics_port), "--max-batch-size", str(max_batch_size),
            "--delay-us", str(MAX_QUEUE_DELAY_US), "--threads", str(INTRA_OP_THREADS)]


def queue_policy(timeout_us: int) -> str:
    """The dynamic batcher's ``default_queue_policy``: a request that has waited
    ``timeout_us`` in Triton's queue is rejected, whatever its own ``timeout``."""
    return (f" default_queue_policy {{ timeout_action: REJECT, default_timeout_microseconds: "
            f"{timeout_us} allow_timeout_override: false }}")


def python_backend_server(venv: TritonVenv, work: Path, onnx: Path, model: str, widths: tuple[int, int],
                          max_batch_size: int, ports: tuple[int, int, int],
                          delay_us: int = MAX_QUEUE_DELAY_US,
                          queue_timeout_us: int | None = None) -> tuple[list[str], dict[str, str]]:
    """tritonserver's argv and environment for ``model`` (its ONNX file ``onnx``, its input and
    output widths) in the plain Python backend, on the (HTTP, gRPC, metrics) ``ports``; its
    dynamic batcher waits ``delay_us``, and with ``queue_timeout_us`` rejects what has
    waited that long (:func:`queue_policy`).

    Writes the model repository and a backend directory under ``work``: the wheel's Python
    backend plus the stub for the venv's Python version, as pytriton itself lays it out."""
    backend = work / "backends" / "python"
    if not backend.exists():
        shutil.copytree(venv.dist / "backends" / "python", backend)
        stub = venv.dist / "python_backend_stubs" / venv.version / "triton_python_backend_stub"
        shutil.copy2(stub, backend)
    version_dir = work / "repository" / model / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(onnx, version_dir / "model.onnx")
    shutil.copy2(ROOT / "bench" / "triton_model.py", version_dir / "model.py")
    (version_dir.parent / "config.pbtxt").write_text(CONFIG_PBTXT.format(
        max_batch_size=max_batch_size, n_in=widths[0], n_out=widths[1], delay_us=delay_us,
        queue_policy="" if queue_timeout_us is None else queue_policy(queue_timeout_us),
        threads=INTRA_OP_THREADS))
    http, grpc, metrics = ports
    argv = [str(venv.dist / "bin" / "tritonserver"), "--model-repository", str(work / "repository"),
            "--backend-directory", str(work / "backends"), "--model-control-mode", "explicit",
            "--load-model", model, "--http-address", "127.0.0.1", "--http-port", str(http),
            "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc), "--metrics-address", "127.0.0.1",
            "--metrics-port", str(metrics)]
    return argv, server_env(venv)


def server_env(venv: TritonVenv) -> dict[str, str]:
    """The environment for either server: the venv's libpython and packages for the stub."""
    libs = [venv.libdir, str(venv.site_packages / "nvidia_pytriton.libs"), os.environ.get("LD_LIBRARY_PATH")]
    return {**os.environ, "LD_LIBRARY_PATH": ":".join(filter(None, libs)),
            "PYTHONPATH": str(venv.site_packages), "PATH": f"{venv.python.parent}:{os.environ['PATH']}",
            "PYTHONUNBUFFERED": "1"}
