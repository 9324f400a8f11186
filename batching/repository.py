"""Reading the model repository: one folder per model, an artifact and an optional config.yaml."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from batching.config import BACKENDS, ConfigError, ModelConfig, TensorSpec
from batching.config_schema import read_config_yaml

log = logging.getLogger(__name__)

_ONNX_TYPES = {1: "FP32", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32", 7: "INT64",
               8: "BYTES", 9: "BOOL", 10: "FP16", 11: "FP64", 12: "UINT32", 13: "UINT64"}


def artifact_backend(folder: Path) -> str | None:
    """The backend whose artifact lies in ``folder``, if any."""
    for backend, artifact in BACKENDS.items():
        if (folder / artifact).exists():
            return backend
    return None


def load_model_config(folder: Path) -> ModelConfig:
    config_file = folder / "config.yaml"
    raw = read_config_yaml(folder.name, config_file) if config_file.exists() else {}
    config = ModelConfig.from_dict(folder.name, raw, artifact_backend(folder))
    if config.backend == "onnx" and not (config.inputs and config.outputs):
        inputs, outputs = onnx_signature(folder / BACKENDS["onnx"])
        config = replace(config, inputs=config.inputs or inputs, outputs=config.outputs or outputs)
    return config


def load_repository(root: Path, only: set[str] | None = None) -> dict[str, ModelConfig]:
    """Every servable model under ``root``; a folder that fails to parse is logged and skipped."""
    models: dict[str, ModelConfig] = {}
    if not root.is_dir():
        log.warning("model repository %s does not exist", root)
        return models
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if only and folder.name not in only:
            continue
        if artifact_backend(folder) is None and not (folder / "config.yaml").exists():
            continue
        try:
            models[folder.name] = load_model_config(folder)
        except (ConfigError, OSError, ValueError) as exc:
            log.error("skipping model %s: %s", folder.name, exc)
    return models


def onnx_signature(path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Inputs and outputs declared by an ONNX graph (symbolic dims become -1)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}

    def spec(value: Any) -> TensorSpec:
        tensor_type = value.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
                     for d in tensor_type.shape.dim)
        return TensorSpec(value.name, _ONNX_TYPES.get(tensor_type.elem_type, "FP32"), dims or (-1,))

    return (tuple(spec(v) for v in graph.input if v.name not in initializers),
            tuple(spec(v) for v in graph.output))
