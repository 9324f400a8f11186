"""workers.backends: each backend loads a tiny model from tmp_path and predicts like numpy."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, RuntimeException

from batching.config import ModelConfig
from batching.errors import ModelFailure
from workers.backends import is_fatal_device_error, is_out_of_memory, load_model

ROOT = Path(__file__).resolve().parents[1]


def _config(backend: str, inputs: tuple[str, ...] = (), outputs: tuple[str, ...] = (),
            **extra: Any) -> ModelConfig:
    def specs(names: tuple[str, ...]) -> list[dict[str, Any]]:
        return [{"name": n, "datatype": "FP32", "shape": [-1, 3]} for n in names]

    raw = {"inputs": specs(inputs), "outputs": specs(outputs), **extra}
    return ModelConfig.from_dict("m", raw, backend)


def _readonly(rows: int, seed: int) -> npt.NDArray[np.float32]:
    """A read-only batch, as the worker gets it from np.frombuffer."""
    data = np.random.default_rng(seed).standard_normal((rows, 3)).astype(np.float32)
    array = np.frombuffer(data.tobytes(), dtype=np.float32).reshape(rows, 3)
    assert not array.flags.writeable
    return array


class DiffAndProduct(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a - b, a * b


class Named(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"double": x * 2, "neg": -x}


def _script(module: torch.nn.Module, path: Path) -> None:
    """Save ``module`` as TorchScript (torch.jit.script is deprecated as of torch 2.13)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit\.script` is deprecated", DeprecationWarning)
        torch.jit.script(module).save(str(path))  # type: ignore[no-untyped-call]


def test_torchscript_positional_inputs_and_named_outputs(tmp_path: Path) -> None:
    _script(DiffAndProduct(), tmp_path / "model.pt")
    model = load_model(_config("torchscript", ("A", "B"), ("DIFF", "PROD")), tmp_path, "cpu")
    a, b = _readonly(4, 0), _readonly(4, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on non-writable numpy arrays
        out = model.predict({"B": b, "A": a})  # dict order must not matter
    assert set(out) == {"DIFF", "PROD"}
    np.testing.assert_allclose(out["DIFF"], a - b, rtol=1e-6)
    np.testing.assert_allclose(out["PROD"], a * b, rtol=1e-6)
    assert isinstance(out["PROD"], np.ndarray) and out["PROD"].dtype == np.float32


def test_torchscript_without_config_names_outputs_by_position(tmp_path: Path) -> None:
    _script(DiffAndProduct(), tmp_path / "model.pt")
    model = load_model(_config("torchscript"), tmp_path, "cpu")
    a, b = _readonly(2, 2), _readonly(2, 3)
    out = model.predict({"x": a, "y": b})
    assert sorted(out) == ["OUTPUT0", "OUTPUT1"]
    np.testing.assert_allclose(out["OUTPUT0"], a - b, rtol=1e-6)


def test_torchscript_output_count_mismatch_is_model_failure(tmp_path: Path) -> None:
    _script(DiffAndProduct(), tmp_path / "model.pt")
    model = load_model(_config("torchscript", ("A", "B"), ("ONLY",)), tmp_path, "cpu")
    with pytest.raises(ModelFailure, match="returned 2 outputs"):
        model.predict({"A": _readonly(2, 0), "B": _readonly(2, 1)})


def test_torchscript_dict_outputs_are_picked_by_name(tmp_path: Path) -> None:
    _script(Named(), tmp_path / "model.pt")
    model = load_model(_config("torchscript", ("x",), ("neg", "double")), tmp_path, "cpu")
    x = _readonly(3, 4)
    out = model.predict({"x": x})
    np.testing.assert_allclose(out["neg"], -x)
    np.testing.assert_allclose(out["double"], x * 2)


def test_torch_export_with_dynamic_batch(tmp_path: Path) -> None:
    batch = torch.export.Dim("batch")
    example = (torch.ones(2, 3), torch.ones(2, 3))
    program = torch.export.export(DiffAndProduct(), example,
                                  dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, str(tmp_path / "model.pt2"))
    model = load_model(_config("torch_export", ("A", "B"), ("DIFF", "PROD")), tmp_path, "cpu")
    a, b = _readonly(5, 5), _readonly(5, 6)
    out = model.predict({"A": a, "B": b})
    np.testing.assert_allclose(out["DIFF"], a - b, rtol=1e-6)
    np.testing.assert_allclose(out["PROD"], a * b, rtol=1e-6)


def _onnx_model(path: Path) -> npt.NDArray[np.float32]:
    """SUM = X + Y and PROJ = X @ W with a symbolic batch dim; returns W."""
    weight = np.arange(6, dtype=np.float32).reshape(3, 2)
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "Y"], ["SUM"]),
         helper.make_node("MatMul", ["X", "W"], ["PROJ"])],
        "tiny",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("SUM", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("PROJ", TensorProto.FLOAT, ["N", 2])],
        initializer=[numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return weight


def test_onnx_without_config(tmp_path: Path) -> None:
    weight = _onnx_model(tmp_path / "model.onnx")
    model = load_model(_config("onnx", parameters={"threads": 1}), tmp_path, "cpu")
    x, y = _readonly(7, 7), _readonly(7, 8)
    out = model.predict({"X": x, "Y": y})
    assert list(out) == ["SUM", "PROJ"]
    np.testing.assert_allclose(out["SUM"], x + y, rtol=1e-6)
    np.testing.assert_allclose(out["PROJ"], x @ weight, rtol=1e-5, atol=1e-6)


def test_onnx_falls_back_to_cpu_without_cuda_provider(tmp_path: Path) -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime has CUDA here")
    _onnx_model(tmp_path / "model.onnx")
    model = load_model(_config("onnx"), tmp_path, "cuda:0")
    out = model.predict({"X": _readonly(1, 0), "Y": _readonly(1, 1)})
    assert out["SUM"].shape == (1, 3)


PYTHON_MODEL = """
    import numpy as np
    from {helper} import SCALE

    class Model:
        def __init__(self, config, device):
            self.config, self.device = config, device

        def predict(self, inputs):
            x = inputs["x"]
            if self.config["parameters"].get("mode") == "list":
                return [x]
            if self.config["parameters"].get("mode") == "scalar":
                return {{"y": 1.0}}
            return {{"y": x * SCALE, "n": [len(x)] * len(x)}}
"""


def _python_model(folder: Path, helper: str) -> None:
    (folder / f"{helper}.py").write_text("SCALE = 3\n")
    (folder / "model.py").write_text(textwrap.dedent(PYTHON_MODEL.format(helper=helper)))


def test_python_model_imports_sibling_and_gets_config(tmp_path: Path) -> None:
    _python_model(tmp_path, "conveyor_test_helper_a")
    model = load_model(_config("python", ("x",), ("y",)), tmp_path, "cpu")
    x = _readonly(4, 9)
    out = model.predict({"x": x})
    np.testing.assert_allclose(out["y"], x * 3)
    assert isinstance(out["n"], np.ndarray) and out["n"].tolist() == [4] * 4
    inner = model._model  # type: ignore[attr-defined]
    assert inner.device == "cpu" and inner.config["outputs"][0]["name"] == "y"
    assert str(tmp_path) not in sys.path


@pytest.mark.parametrize(("mode", "message"), [("list", "expected a dict"), ("scalar", "axis 0")])
def test_python_model_bad_outputs_are_model_failures(tmp_path: Path, mode: str,
                                                     message: str) -> None:
    _python_model(tmp_path, f"conveyor_test_helper_{mode}")
    model = load_model(_config("python", parameters={"mode": mode}), tmp_path, "cpu")
    with pytest.raises(ModelFailure, match=message):
        model.predict({"x": _readonly(2, 0)})


def test_python_model_missing_declared_output(tmp_path: Path) -> None:
    _python_model(tmp_path, "conveyor_test_helper_b")
    model = load_model(_config("python", ("x",), ("z",)), tmp_path, "cpu")
    with pytest.raises(ModelFailure, match="z"):
        model.predict({"x": _readonly(2, 0)})


def test_python_model_without_model_class(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text("VALUE = 1\n")
    with pytest.raises(ModelFailure, match="no class Model"):
        load_model(_config("python"), tmp_path, "cpu")


def test_python_backend_does_not_import_torch(tmp_path: Path) -> None:
    _python_model(tmp_path, "conveyor_test_helper_c")
    script = (
        "import sys; from pathlib import Path; import numpy as np\n"
        "from batching.config import ModelConfig; from workers.backends import load_model\n"
        "m = load_model(ModelConfig.from_dict('m', {}, 'python'), Path(sys.argv[1]), 'cpu')\n"
        "m.predict({'x': np.ones((2, 3))})\n"
        "assert 'torch' not in sys.modules and 'onnxruntime' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, check=True)


def test_is_out_of_memory() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert is_out_of_memory(oom)
    assert not is_out_of_memory(RuntimeError("boom"))
    assert not is_out_of_memory(RuntimeError("out of memory"))  # neither torch's nor ORT's type
    try:
        try:
            raise oom
        except RuntimeError as inner:
            raise ValueError("model wrapped it") from inner
    except ValueError as wrapped:
        assert is_out_of_memory(wrapped)


def test_is_out_of_memory_onnxruntime() -> None:
    assert is_out_of_memory(RuntimeException("BFCArena: Failed to allocate memory for buffer"))
    assert is_out_of_memory(Fail("CUDA failure 2: out of memory"))
    assert not is_out_of_memory(Fail("Invalid rank for input: X"))


@pytest.mark.parametrize("text", [
    "CUDA error: an illegal memory access was encountered",
    "CUDA error: device-side assert triggered",
    "CUDA error: unspecified launch failure",
    "CUDA error: an illegal instruction was encountered",
    "CUDA error: misaligned address",
])
def test_is_fatal_device_error(text: str) -> None:
    assert is_fatal_device_error(RuntimeError(text))


def test_ordinary_errors_are_not_fatal() -> None:
    assert not is_fatal_device_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_fatal_device_error(ValueError("CUDA out of memory"))
