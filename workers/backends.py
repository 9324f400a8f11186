"""Model backends: load one model's artifact and run a batch of numpy arrays through it.

Every backend answers ``predict(inputs) -> outputs`` with arrays whose axis 0 is the batch
rows. torch and onnxruntime are imported only by the loader that needs them, so a
``python`` model never pays for (or requires) either.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from batching.config import ModelConfig
from batching.errors import ModelFailure
from workers.cpu_threads import cpu_threads
from workers.triton_python import TritonPythonAdapter, utils_module

log = logging.getLogger(__name__)

Arrays = dict[str, npt.NDArray[Any]]

_OOM_TEXT = ("failed to allocate memory", "out of memory")
_FATAL_TEXT = ("illegal memory access", "device-side assert", "unspecified launch failure",
               "cuda error: an illegal instruction", "misaligned address")
_module_ids = itertools.count()
_PATH = re.compile(r"(?<![\w./\\])(?:[A-Za-z]:)?[\\/](?:[^\s\\/'\":]+[\\/])*([^\s\\/'\":]+)")
"""An absolute file path (POSIX or Windows); group 1 is its last component, all that is
kept of it."""
SUMMARY_MAX = 300


class LoadedModel(Protocol):
    def predict(self, inputs: Arrays) -> Arrays: ...


def load_model(config: ModelConfig, folder: Path, device: str) -> LoadedModel:
    """Load the artifact of ``config.backend`` from ``folder`` onto ``device`` ("cpu", "cuda:N")."""
    loader = _LOADERS[config.backend]
    model = loader(config, folder / config.artifact, device)
    if any(spec.reshape is not None for spec in (*config.inputs, *config.outputs)):
        return _Reshaped(config, model)
    return model


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a torch or onnxruntime allocation failure (anywhere in the exception chain)."""
    torch = sys.modules.get("torch")
    oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    for item in _chain(exc):
        if isinstance(oom_type, type) and isinstance(item, oom_type):
            return True
        if type(item).__module__.startswith("onnxruntime") and _mentions(item, _OOM_TEXT):
            return True
    return False


def is_fatal_device_error(exc: BaseException) -> bool:
    """True for a CUDA error that poisons the context: the process must restart to recover."""
    return any(_mentions(item, _FATAL_TEXT) for item in _chain(exc))


def error_summary(exc: BaseException) -> str:
    """A model's exception as its clients see it: one line, no file paths, at most
    ``SUMMARY_MAX`` characters. The worker logs the whole text and traceback.

    The first line of the message, or, after a traceback the message carries (TorchScript
    quotes its interpreter's and the model's source), the last line: the error itself.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    name = type(exc).__name__
    if not lines:
        return name
    traced = any(line.startswith("Traceback") for line in lines)
    line = _PATH.sub(lambda match: match.group(1), lines[-1] if traced else lines[0])
    if not line.startswith(f"{name}:"):
        line = f"{name}: {line}"
    return line if len(line) <= SUMMARY_MAX else line[:SUMMARY_MAX - 3] + "..."


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _mentions(exc: BaseException, needles: tuple[str, ...]) -> bool:
    text = str(exc).lower()
    return any(needle in text for needle in needles)


def _checked(config: ModelConfig, outputs: Arrays, inputs: Arrays) -> Arrays:
    """Fail clearly unless every declared output is present and each has one row per input
    row (a model without a batch dim: any shape)."""
    missing = [spec.name for spec in config.outputs if spec.name not in outputs]
    if missing:
        raise ModelFailure(f"{config.name}: model returned no {missing} (got {sorted(outputs)})")
    if not config.batched:
        return outputs
    rows = next((array.shape[0] for array in inputs.values() if array.ndim), None)
    for name, array in outputs.items():
        if rows is not None and (array.ndim == 0 or array.shape[0] != rows):
            raise ModelFailure(f"{config.name}: output {name} has shape {list(array.shape)}, "
                               f"but axis 0 must hold the batch's {rows} rows")
    return outputs


class _Reshaped:
    """Triton's ``reshape``: inputs reach the model in the shape it takes, and its outputs
    leave in the declared shape (each row alike, the batch dim kept)."""

    def __init__(self, config: ModelConfig, model: LoadedModel) -> None:
        self._model = model
        self._batched = config.batched
        self._inputs = {t.name: t.reshape for t in config.inputs if t.reshape is not None}
        self._outputs = {t.name: t.shape[1:] if config.batched else t.shape
                         for t in config.outputs if t.reshape is not None}

    def _shaped(self, array: npt.NDArray[Any], dims: tuple[int, ...]) -> npt.NDArray[Any]:
        return array.reshape((array.shape[0], *dims) if self._batched else dims)

    def predict(self, inputs: Arrays) -> Arrays:
        given = {name: self._shaped(array, self._inputs[name]) if name in self._inputs
                 else array for name, array in inputs.items()}
        outputs = self._model.predict(given)
        return {name: self._shaped(array, self._outputs[name]) if name in self._outputs
                else array for name, array in outputs.items()}


class _TorchModel:
    """TorchScript or torch.export module: inputs positional, outputs named from the config."""

    def __init__(self, config: ModelConfig, module: Callable[..., Any], device: str) -> None:
        self._config = config
        self._module = module
        self._device = device
        self._pinned: dict[str, list[Any]] = {}
        """Per input, two page-locked host buffers that batches are stacked into in turn
        (CUDA only): one batch's while the model runs, the next one's stacked meanwhile."""
        self._turns: dict[str, int] = {}
        """Per input, which of its two buffers the last batch was stacked into."""
        self._staged: dict[str, list[tuple[npt.NDArray[Any], Any]]] = {}
        """Per input, the arrays :meth:`staging` handed out last, with their torch views."""

    def staging(self, name: str, shape: tuple[int, ...],
                dtype: np.dtype[Any]) -> npt.NDArray[Any] | None:
        """A page-locked array for a batch's input ``name`` (``Batch.stacked_inputs``
        stacks into it): its copy to the device runs at full speed and does not block.
        The two buffers of an input take turns: a batch is stacked into one while the
        model runs the batch stacked in the other, whose outputs are back on the host
        before a third batch is stacked there. None on a CPU."""
        if not self._device.startswith("cuda"):
            return None
        import torch

        size = int(np.prod(shape)) * dtype.itemsize
        pair = self._pinned.setdefault(name, [None, None])
        turn = self._turns[name] = 1 - self._turns.get(name, 1)
        buffer = pair[turn]
        if buffer is None or buffer.numel() < size:
            buffer = pair[turn] = torch.empty(size + size // 4, dtype=torch.uint8,
                                              pin_memory=True)
        array: npt.NDArray[Any] = buffer[:size].numpy().view(dtype).reshape(shape)
        tensor_type = torch.from_numpy(array[:0]).dtype
        staged = self._staged.setdefault(name, [])
        staged.append((array, buffer[:size].view(tensor_type).view(shape)))
        del staged[:-2]
        return array

    def predict(self, inputs: Arrays) -> Arrays:
        import torch

        names = [spec.name for spec in self._config.inputs] or list(inputs)
        with torch.inference_mode():
            args = [self._on_device(name, inputs[name]) for name in names]
            result = self._module(*args)
        outputs = {name: self._to_numpy(name, value) for name, value in self._name(result).items()}
        return _checked(self._config, outputs, inputs)

    def _on_device(self, name: str, array: npt.NDArray[Any]) -> Any:
        import torch

        for staged, tensor in self._staged.get(name, ()):
            if staged is array:  # pinned: its copy is queued ahead of the kernels
                return tensor.to(self._device, non_blocking=True)
        # from_numpy needs a writable, C-ordered array; np.frombuffer views are read-only.
        return torch.from_numpy(np.require(array, requirements=["C", "W"])).to(self._device)

    def _name(self, result: Any) -> dict[str, Any]:
        if isinstance(result, Mapping):
            if not self._config.outputs:
                return {str(name): value for name, value in result.items()}
            return {spec.name: result[spec.name] for spec in self._config.outputs
                    if spec.name in result}
        values = list(result) if isinstance(result, (tuple, list)) else [result]
        names = ([spec.name for spec in self._config.outputs]
                 or [f"OUTPUT{i}" for i in range(len(values))])
        if len(values) != len(names):
            raise ModelFailure(f"{self._config.name}: model returned {len(values)} outputs, "
                               f"config declares {len(names)} ({names})")
        return dict(zip(names, values, strict=True))

    def _to_numpy(self, name: str, value: Any) -> npt.NDArray[Any]:
        import torch

        if not isinstance(value, torch.Tensor):
            raise ModelFailure(f"{self._config.name}: output {name} is a {type(value).__name__}, "
                               "not a tensor")
        return value.cpu().numpy()


class _OnnxModel:
    """onnxruntime session: inputs fed by name, outputs named by the graph."""

    def __init__(self, config: ModelConfig, session: Any) -> None:
        self._config = config
        self._session = session
        self._names = [output.name for output in session.get_outputs()]

    def predict(self, inputs: Arrays) -> Arrays:
        results = self._session.run(self._names, inputs)
        return _checked(self._config, dict(zip(self._names, results, strict=True)), inputs)


class _PythonModel:
    """A ``model.py`` whose ``Model.predict`` maps input names to arrays."""

    def __init__(self, config: ModelConfig, model: Any) -> None:
        self._config = config
        self._model = model

    def predict(self, inputs: Arrays) -> Arrays:
        result = self._model.predict(inputs)
        if not isinstance(result, Mapping):
            raise ModelFailure(f"{self._config.name}: Model.predict returned a "
                               f"{type(result).__name__}, expected a dict of arrays")
        outputs = {str(name): np.asarray(value) for name, value in result.items()}
        return _checked(self._config, outputs, inputs)


def _torch_threads(config: ModelConfig) -> None:
    """Size torch's pools before the model runs: the inter-op pool can be sized only once,
    before any parallel work, which in a freshly spawned inference process has not begun."""
    import torch

    threads = cpu_threads(config)
    torch.set_num_threads(threads.intra_op)
    if torch.get_num_interop_threads() != threads.inter_op:
        try:
            torch.set_num_interop_threads(threads.inter_op)
        except RuntimeError as exc:  # this process ran parallel work already (another model)
            log.warning("%s: keeping %d inter-op threads: %s", config.name,
                        torch.get_num_interop_threads(), exc)
    log.info("%s: torch runs %d intra-op, %d inter-op threads", config.name,
             torch.get_num_threads(), torch.get_num_interop_threads())


def _load_torchscript(config: ModelConfig, path: Path, device: str) -> LoadedModel:
    import torch

    _torch_threads(config)
    with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; we still serve it
        warnings.filterwarnings("ignore", r"`torch\.jit\.load` is deprecated", DeprecationWarning)
        module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
    module.eval()
    return _TorchModel(config, module, device)


def _load_torch_export(config: ModelConfig, path: Path, device: str) -> LoadedModel:
    import torch
    from torch.export.passes import move_to_device_pass

    _torch_threads(config)
    # move_to_device_pass also rewrites device constants baked into the graph, which
    # GraphModule.to() would miss. The exported module refuses .eval(); the graph keeps
    # whichever mode it was exported in.
    program = move_to_device_pass(torch.export.load(str(path)), device)
    return _TorchModel(config, program.module(), device)


def _load_onnx(config: ModelConfig, path: Path, device: str) -> LoadedModel:
    import onnxruntime as ort

    options = _onnx_options(config)
    providers: list[Any] = ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" in ort.get_available_providers():
            device_id = int(device.partition(":")[2] or 0)
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device_id}))
        else:
            log.warning("%s: onnxruntime has no CUDA provider; running on CPU", config.name)
    session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    return _OnnxModel(config, session)


def _onnx_options(config: ModelConfig) -> Any:
    """onnxruntime's threads from ``cpu_threads``. Spinning threads poll for work instead of
    sleeping: faster wake-ups, but a spinning pool takes the cores the API, Redis and other
    instances need between batches, so it is off unless configured."""
    import onnxruntime as ort

    threads = cpu_threads(config)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads.intra_op
    options.inter_op_num_threads = threads.inter_op
    options.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if threads.inter_op > 1
                              else ort.ExecutionMode.ORT_SEQUENTIAL)
    spin = "1" if threads.spin else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    log.info("%s: onnxruntime runs %d intra-op, %d inter-op threads, spinning %s", config.name,
             threads.intra_op, threads.inter_op, "on" if threads.spin else "off")
    return options


def _load_python(config: ModelConfig, path: Path, device: str) -> LoadedModel:
    module_name = f"conveyor_model_{next(_module_ids)}_{config.name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelFailure(f"{config.name}: cannot import {path.name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    folder = str(path.parent)
    sys.path.insert(0, folder)  # so model.py may import its siblings
    utils_module()  # a Triton model.py imports triton_python_backend_utils
    try:
        spec.loader.exec_module(module)
        model_class = getattr(module, "Model", None)
        triton_class = getattr(module, "TritonPythonModel", None)
        if model_class is None and triton_class is not None:
            return _PythonModel(config, TritonPythonAdapter(config, triton_class, path.parent,
                                                            device))
        if model_class is None:
            raise ModelFailure(f"{config.name}: {path.name} defines no class Model (or "
                               "Triton's TritonPythonModel)")
        model = model_class(dataclasses.asdict(config), device)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    finally:
        sys.path.remove(folder)
    return _PythonModel(config, model)


_LOADERS: dict[str, Callable[[ModelConfig, Path, str], LoadedModel]] = {
    "torchscript": _load_torchscript,
    "torch_export": _load_torch_export,
    "onnx": _load_onnx,
    "python": _load_python,
}
