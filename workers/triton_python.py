"""Serving a Triton Python-backend ``model.py`` (class ``TritonPythonModel``) unchanged.

Such a model imports ``triton_python_backend_utils`` (usually as ``pb_utils``); this module
stands in for it, with the part of its interface a model uses to read requests and build
responses (tensors, requests, responses, errors, the model's configuration). conveyor
hands ``execute`` (``def`` or ``async def``) one request holding the whole batch, its
inputs stacked on the batch axis, as Triton's dynamic batcher hands it several: a model
written for Triton handles either. A request the model builds calls another served model
(Triton's BLS: ``exec``, ``async_exec``) as batching/bls.py does, a failure answered in
the response, not raised. Written from the interface's documented behaviour; no Triton code.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from batching import bls
from batching.config import ModelConfig
from batching.datatypes import to_numpy
from batching.errors import (
    ConveyorError,
    InvalidInput,
    ModelFailure,
    ModelNotFound,
    Overloaded,
    Unavailable,
    Unsupported,
)
from batching.triton_config import triton_config

MODULE = "triton_python_backend_utils"
log = logging.getLogger("conveyor.triton_python")
Arrays = dict[str, npt.NDArray[Any]]


class Tensor:
    def __init__(self, name: str, array: Any) -> None:
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> npt.NDArray[Any]:
        return self._array

    def is_cpu(self) -> bool:
        return True


class PreferredMemory:
    """Where a BLS call's outputs should live; accepted, and outputs are numpy on the CPU."""

    def __init__(self, preferred_memory_type: int = 0, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class InferenceRequest:
    """A request ``execute`` receives, or one the model builds to call another served
    model (BLS): :meth:`exec` and :meth:`async_exec` run it as a call of batching/bls.py."""

    def __init__(self, *, model_name: str = "", requested_output_names: Sequence[str] = (),
                 inputs: Sequence[Tensor] = (), model_version: int | str = -1,
                 request_id: str = "", correlation_id: int = 0, flags: int = 0,
                 timeout: int = 0, preferred_memory: PreferredMemory | None = None,
                 trace: Any = None, parameters: Mapping[str, Any] | str | None = None) -> None:
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)
        self.model_name, self.model_version = model_name, model_version
        self._request_id, self._correlation_id, self._flags = request_id, correlation_id, flags
        self.timeout_us = timeout
        self._parameters = parameters if isinstance(parameters, str) \
            else json.dumps(dict(parameters or {}))

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._requested)

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def parameters(self) -> str:
        return self._parameters

    def is_cancelled(self) -> bool:
        return False

    def exec(self, decoupled: bool = False) -> InferenceResponse:
        """Run this request through model ``model_name``; its response, which holds the
        error if it failed (never raised)."""
        refused = _refusal(self, decoupled)
        if refused is not None:
            return _failed(f"model {self.model_name!r} called: {refused}", TritonError.UNSUPPORTED)
        timeout_s = self.timeout_us / 1e6 if self.timeout_us > 0 else None
        try:
            outputs = bls.infer(self.model_name, {t.name(): t.as_numpy() for t in self._inputs},
                                timeout_s=timeout_s)
        except ConveyorError as exc:
            return _failed(exc.message, _error_code(exc))
        wanted = self._requested or list(outputs)
        missing = [name for name in wanted if name not in outputs]
        if missing:
            return _failed(f"model {self.model_name!r} has no output {missing[0]!r}",
                           TritonError.INVALID_ARG)
        return InferenceResponse([Tensor(name, outputs[name]) for name in wanted])

    async def async_exec(self, decoupled: bool = False) -> InferenceResponse:
        """:meth:`exec` awaited: several run at once under ``asyncio.gather``."""
        return await asyncio.to_thread(self.exec, decoupled)


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, \
        CANCELLED = range(8)

    def __init__(self, message: str, code: int = 0) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    pass


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None,
                 error: TritonError | None = None, parameters: Any = None) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def _failed(message: str, code: int) -> InferenceResponse:
    return InferenceResponse(error=TritonError(message, code))


def _refusal(request: InferenceRequest, decoupled: bool) -> str | None:
    """Why a BLS call of ``request`` cannot be run (None: it can)."""
    if decoupled:
        return "exec(decoupled=True) is not supported (decoupled models are not served)"
    if request.model_version not in (-1, "", "-1"):
        return (f"model_version {request.model_version} is not supported (a call runs the "
                "called model's newest served version)")
    if request.flags() or request.correlation_id():
        return "sequence flags and correlation_id are not supported (no sequence batching)"
    if json.loads(request.parameters()):
        return "request parameters are not supported in a call"
    return None


_ERROR_CODES: tuple[tuple[type[ConveyorError], int], ...] = (
    (ModelNotFound, TritonError.NOT_FOUND), (InvalidInput, TritonError.INVALID_ARG),
    (Overloaded, TritonError.UNAVAILABLE), (Unavailable, TritonError.UNAVAILABLE),
    (Unsupported, TritonError.UNSUPPORTED))


def _error_code(exc: ConveyorError) -> int:
    """The ``TritonError`` code of a call's error, or of what caused it."""
    for error in (exc, exc.__cause__):
        code = next((c for cls, c in _ERROR_CODES if isinstance(error, cls)), None)
        if code is not None:
            return code
    return TritonError.INTERNAL


class Logger:
    @staticmethod
    def log_info(message: str) -> None:
        log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        log.debug("%s", message)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def _config_by_name(model_config: Mapping[str, Any], key: str, name: str) -> Any:
    return next((t for t in model_config.get(key, []) if t.get("name") == name), None)


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> Any:
    return _config_by_name(model_config, "input", name)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> Any:
    return _config_by_name(model_config, "output", name)


def triton_string_to_numpy(triton_type: str) -> Any:
    datatype = triton_type.removeprefix("TYPE_")
    return np.object_ if datatype == "STRING" else to_numpy(datatype).type


def utils_module() -> types.ModuleType:
    """The stand-in ``triton_python_backend_utils`` module (one per process)."""
    module = sys.modules.get(MODULE)
    if module is None:
        module = types.ModuleType(MODULE, __doc__)
        for name in ("Tensor", "PreferredMemory", "InferenceRequest", "InferenceResponse", "TritonError",
                     "TritonModelException", "Logger", "get_input_tensor_by_name",
                     "get_output_tensor_by_name", "get_input_config_by_name",
                     "get_output_config_by_name", "triton_string_to_numpy"):
            setattr(module, name, globals()[name])
        module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1  # type: ignore[attr-defined]
        module.TRITONSERVER_MEMORY_CPU = 0  # type: ignore[attr-defined]
        module.TRITONSERVER_MEMORY_CPU_PINNED = 1  # type: ignore[attr-defined]
        module.TRITONSERVER_MEMORY_GPU = 2  # type: ignore[attr-defined]
        sys.modules[MODULE] = module
    return module


class TritonPythonAdapter:
    """A ``TritonPythonModel`` behind conveyor's ``predict(inputs) -> outputs``."""

    def __init__(self, config: ModelConfig, model_class: type, folder: Path,
                 device: str) -> None:
        self._config = config
        self._version = folder.name if config.versions else "1"
        self._model = model_class()
        initialize = getattr(self._model, "initialize", None)
        if initialize is not None:
            gpu = device.startswith("cuda")
            initialize({
                "model_config": json.dumps(triton_config(config)),
                "model_instance_kind": "GPU" if gpu else "CPU",
                "model_instance_name": f"{config.name}_0",
                "model_instance_device_id": device.partition(":")[2] or "0",
                "model_repository": str(folder.parent if config.versions else folder),
                "model_version": self._version,
                "model_name": config.name,
            })

    def predict(self, inputs: Arrays) -> Arrays:
        request = InferenceRequest(
            model_name=self._config.name, model_version=self._version,
            requested_output_names=[t.name for t in self._config.outputs],
            inputs=[Tensor(n, a) for n, a in inputs.items()])
        try:
            responses = self._model.execute([request])
            if inspect.iscoroutine(responses):  # ``async def execute``, as BLS models write it
                responses = asyncio.run(responses)
        except TritonModelException as exc:
            raise ModelFailure(f"{self._config.name}: {exc}") from None
        if not isinstance(responses, list) or len(responses) != 1 \
                or not isinstance(responses[0], InferenceResponse):
            raise ModelFailure(f"{self._config.name}: TritonPythonModel.execute must return one "
                               "InferenceResponse per request")
        error = responses[0].error()
        if error is not None:
            raise ModelFailure(f"{self._config.name}: {error.message()}")
        return {t.name(): t.as_numpy() for t in responses[0].output_tensors()}
