"""Shared pieces of the protocol tests: a model repository, a stack with a gRPC port, samples.

The repository is built in a temporary folder: the ``alltypes`` model (one input and
output per KServe datatype), the ``echo`` and ``slow`` test models, and ``onnx_mlp``,
an ONNX graph written here with no ``config.yaml`` beside it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import TEST_MODELS, Stack
from tests.procs import ROOT, RedisServer, free_port

PROTOCOL_MODELS = ROOT / "tests" / "protocol_models"
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BYTES"]
BYTES_SAMPLES = [b"", "héllo wörld ✓".encode(), b"plain", "日本語".encode(), b"x" * 300, b""]


def onnx_weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return (rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32))


def write_onnx_model(folder: Path) -> Path:
    """``X`` FP32 [N, 4] -> ``Y`` = relu(X W + b) FP32 [N, 3] and ``C`` = argmax(Y) INT64 [N]."""
    weight, bias = onnx_weights()
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]),
         helper.make_node("Add", ["XW", "B"], ["Z"]),
         helper.make_node("Relu", ["Z"], ["Y"]),
         helper.make_node("ArgMax", ["Y"], ["C"], axis=1, keepdims=0)],
        "onnx_mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("C", TensorProto.INT64, ["batch"])],
        initializer=[numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    folder.mkdir(parents=True)
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    return path


def copied_repository(root: Path, *folders: Path) -> Path:
    """``root``, a model repository of a test's own, holding a copy of each of ``folders``
    under its name."""
    for folder in folders:
        shutil.copytree(folder, root / folder.name)
    return root


def build_repository(root: Path) -> Path:
    copied_repository(root, PROTOCOL_MODELS / "alltypes", TEST_MODELS / "echo",
                      TEST_MODELS / "slow")
    write_onnx_model(root / "onnx_mlp")
    return root


def protocol_stack(redis_server: RedisServer, logdir: Path, repository: Path,
                   **env: str) -> Iterator[Stack]:
    """One API (HTTP and gRPC) and one worker over ``repository``, with ``env`` on top;
    yields it ready. Repository control is on: the protocol tests load and unload."""
    grpc_port = free_port()
    stack = Stack(redis_server.url, repository, logdir,
                  extra_env={"CONVEYOR_GRPC_PORT": str(grpc_port),
                             "CONVEYOR_MODEL_CONTROL": "explicit", **env})
    stack.add_api()
    stack.add_worker()
    try:
        stack.wait_ready(timeout=90)
        yield stack
    finally:
        stack.stop()


def grpc_url(stack: Stack) -> str:
    return f"127.0.0.1:{stack.extra_env['CONVEYOR_GRPC_PORT']}"


def http_host(stack: Stack) -> str:
    return stack.url.removeprefix("http://")


def sample(rows: int = 2, cols: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """One array per datatype, covering each integer type's extremes and empty BYTES."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    size = rows * cols
    for datatype in DATATYPES:
        if datatype == "BOOL":
            flat = rng.integers(0, 2, size).astype(np.bool_)
        elif datatype == "BYTES":
            flat = np.array([BYTES_SAMPLES[(i + seed) % len(BYTES_SAMPLES)] for i in range(size)],
                            dtype=np.object_)
        elif datatype.startswith(("UINT", "INT")):
            dtype = np.dtype(datatype.lower())
            info = np.iinfo(dtype)
            flat = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
            flat[:2] = [info.min, info.max]
        else:
            flat = rng.normal(size=size).astype(np.dtype(f"float{datatype[2:]}"))
        arrays[datatype] = flat.reshape(rows, cols)
    return arrays


def assert_round_trip(sent: dict[str, np.ndarray], got: dict[str, np.ndarray],
                      json_bytes: bool = False) -> None:
    """``got`` maps datatype -> returned array. JSON BYTES come back as str (as from Triton)."""
    for datatype, array in sent.items():
        out = got[datatype]
        assert out.shape == array.shape, datatype
        if datatype == "BYTES":
            expected = [v.decode() for v in array.ravel()] if json_bytes else list(array.ravel())
            assert list(out.ravel()) == expected
        else:
            assert out.dtype == array.dtype, datatype
            np.testing.assert_array_equal(out, array, err_msg=datatype)
