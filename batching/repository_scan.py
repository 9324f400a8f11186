"""Reading the model repository: one folder per model, an artifact and an optional config.yaml."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from batching.config import BACKENDS, ConfigError, ModelConfig, TensorSpec
from batching.config_schema import read_config_yaml
from batching.names import model_folder

log = logging.getLogger(__name__)

_ONNX_TYPES = {1: "FP32", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32", 7: "INT64",
               8: "BYTES", 9: "BOOL", 10: "FP16", 11: "FP64", 12: "UINT32", 13: "UINT64"}
_ABSOLUTE = re.compile(r"(?<![\w.~/:])/(?:[^\s'\"/:,]+/)+([^\s'\"/:,]+)")
"""An absolute path (not a URL's): reasons keep only its last component."""


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


@dataclass(frozen=True, slots=True)
class RepositoryScan:
    """What a scan of the repository found: the models that parse, and the ones that do
    not with the reason (one broken folder never hides the others)."""

    models: dict[str, ModelConfig] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def is_model_folder(folder: Path) -> bool:
    """A folder that holds an artifact or a ``config.yaml`` (hidden folders never do)."""
    return (folder.is_dir() and not folder.name.startswith(".")
            and (artifact_backend(folder) is not None or (folder / "config.yaml").exists()))


def model_folders(root: Path) -> list[Path]:
    """Every model folder under ``root`` with a valid name that resolves inside it."""
    if not root.is_dir():
        return []
    folders = []
    for folder in sorted(root.iterdir()):
        if not is_model_folder(folder):
            continue
        if model_folder(root, folder.name) is None:
            log.warning("ignoring folder %r: not a valid model name, or outside the "
                        "repository", folder.name)
            continue
        folders.append(folder)
    return folders


def scan_repository(root: Path, only: set[str] | None = None) -> RepositoryScan:
    """Every model folder under ``root`` (or those in ``only``), parsed or failed."""
    scan = RepositoryScan()
    if not root.is_dir():
        log.warning("model repository %s does not exist", root)
    for folder in model_folders(root):
        if only and folder.name not in only:
            continue
        try:
            scan.models[folder.name] = load_model_config(folder)
        except Exception as exc:  # one model's config never stops the others
            scan.failed[folder.name] = failure_reason(folder, exc)
            log.error("model %s is unavailable: %s", folder.name, scan.failed[folder.name])
    return scan


def failure_reason(folder: Path, exc: BaseException) -> str:
    """One line naming the model folder and why it failed (a config error's message, or
    the exception's type and message), with no server path in it."""
    message = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
    text = scrub_paths(" ".join(message.split()), folder.parent)
    return text if text.startswith(folder.name) else f"{folder.name}: {text}"


def scrub_paths(text: str, root: Path) -> str:
    """``text`` with paths inside ``root`` made relative to it and any other absolute
    path cut to its last component."""
    for prefix in {str(root.resolve()), str(root.absolute()), str(root)}:
        text = text.replace(prefix.rstrip("/") + "/", "")
    return _ABSOLUTE.sub(r"\1", text)


def as_text(raw: bytes | str) -> str:
    """A Redis reply as text, whether or not the client decodes replies."""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def record_value(state: str, at: float) -> bytes:
    """A repository hash value: ``{"state": "loaded"|"unloaded", "ts": epoch_s}``."""
    return json.dumps({"state": state, "ts": at}).encode()


@dataclass(frozen=True, slots=True)
class Record:
    """A repository hash value read back; ``state`` is "" for a value that is not one."""

    state: str
    ts: float


def parse_record(raw: bytes | str | None) -> Record:
    """Read a repository hash value; anything malformed (written by hand) reads as no
    state, so it is never acted on and never stops a reader."""
    try:
        value = json.loads(raw) if raw else {}
        state, ts = value.get("state"), float(value.get("ts", 0))
    except (ValueError, TypeError, AttributeError):
        return Record("", 0.0)
    return Record(state if state in ("loaded", "unloaded") else "", ts)


def stale_entries(root: Path, names: Iterable[str]) -> list[str]:
    """Recorded names whose model no longer exists: an invalid name, or no folder under
    ``root`` (a folder that exists but fails to parse is kept)."""
    return sorted(n for n in names if model_folder(root, n) is None)


def status_table(rows: Iterable[tuple[str, str]]) -> str:
    """Models and their states as Triton prints them at start: Model | Version | Status."""
    lines = [("Model", "Version", "Status"), *((m, "1", s) for m, s in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
            for line in lines]
    return "\n".join([rule, body[0], rule, *body[1:], rule])


def state_rows(loaded: Iterable[str], failed: Mapping[str, str],
               unloaded: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(model, status) rows for :func:`status_table`: loaded models, unloaded ones not
    loaded again, and failed ones with the reason."""
    names = set(loaded)
    rows = [(name, "LOADED") for name in names]
    rows += [(name, "UNLOADED") for name in unloaded if name not in names]
    rows += [(name, f"UNAVAILABLE: {reason}") for name, reason in failed.items()]
    return sorted(rows)


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
