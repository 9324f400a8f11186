"""Serving a Triton Python-backend ``model.py`` (class ``TritonPythonModel``) unchanged.

Such a model imports ``triton_python_backend_utils`` (usually as ``pb_utils``); this module
stands in for it, with the part of its interface a model uses to read requests and build
responses (tensors, requests, responses, errors, the model's configuration). conveyor
hands ``execute`` one request holding the whole batch, its inputs stacked on the batch
axis, as Triton's dynamic batcher hands it several: a model written for Triton handles
either. Written from the interface's documented behaviour; no Triton code.
"""

from __future__ import annotations

import json
import logging
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from batching.config import ModelConfig
from batching.datatypes import to_numpy
from batching.errors import ModelFailure
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


class InferenceRequest:
    def __init__(self, inputs: list[Tensor], requested: list[str], model: str,
                 version: str) -> None:
        self._inputs = inputs
        self._requested = requested
        self.model_name, self.model_version = model, version

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._requested)

    def request_id(self) -> str:
        return ""

    def correlation_id(self) -> int:
        return 0

    def flags(self) -> int:
        return 0

    def parameters(self) -> str:
        return "{}"

    def is_cancelled(self) -> bool:
        return False


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS = range(7)

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
        for name in ("Tensor", "InferenceRequest", "InferenceResponse", "TritonError",
                     "TritonModelException", "Logger", "get_input_tensor_by_name",
                     "get_output_tensor_by_name", "get_input_config_by_name",
                     "get_output_config_by_name", "triton_string_to_numpy"):
            setattr(module, name, globals()[name])
        module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1  # type: ignore[attr-defined]
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
        request = InferenceRequest([Tensor(n, a) for n, a in inputs.items()],
                                   [t.name for t in self._config.outputs], self._config.name,
                                   self._version)
        try:
            responses = self._model.execute([request])
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
