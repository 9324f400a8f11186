"""Reading the model repository: one folder per model, an artifact and an optional config.yaml."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from batching.config import BACKENDS, ConfigError, ModelConfig, TensorSpec
from batching.config_yaml import read_config_yaml
from batching.ensemble import EnsembleDraft, EnsemblePlan, ensemble_draft, plan_ensemble
from batching.names import model_folder
from batching.triton_repository import pbtxt_config

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


def version_folders(folder: Path) -> list[int]:
    """The version folders of a model (``1/``, ``2/``...), as numbers; other folders are
    not versions."""
    try:
        return sorted(int(entry.name) for entry in folder.iterdir()
                      if entry.name.isascii() and entry.name.isdigit() and entry.is_dir())
    except OSError:
        return []


def read_raw_config(folder: Path) -> dict[str, Any]:
    """The ``config.yaml`` mapping of a model folder: its ``config.yaml``, or its Triton
    ``config.pbtxt`` read into the same keys, or none (empty)."""
    name, yaml_file, pbtxt_file = folder.name, folder / "config.yaml", folder / "config.pbtxt"
    if yaml_file.exists() and pbtxt_file.exists():
        raise ConfigError(f"{name}: both config.yaml and config.pbtxt are here: keep one")
    if yaml_file.exists():
        return read_config_yaml(name, yaml_file)
    if pbtxt_file.exists():
        try:
            text = pbtxt_file.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{name}: config.pbtxt cannot be read ({exc.strerror})") from None
        return pbtxt_config(name, text)
    return {}


def load_model_config(folder: Path, override: dict[str, Any] | None = None) -> ModelConfig:
    """The model of ``folder``: its configuration (``override``, a repository load's, in
    place of the folder's file), its served versions, and what its ONNX graph adds."""
    draft = ensemble_draft(folder) if override is None else None
    if draft is not None:
        raise _not_a_model(folder, draft)
    raw = read_raw_config(folder) if override is None else override
    found = version_folders(folder)
    probe = next((folder / str(v) for v in reversed(found)
                  if artifact_backend(folder / str(v))), folder)
    try:
        config = ModelConfig.from_dict(folder.name, raw, artifact_backend(probe))
    except ConfigError as exc:
        source = ("the load's config" if override is not None
                  else "config.pbtxt" if (folder / "config.pbtxt").exists() else "")
        if not source:
            raise
        name = folder.name
        raise ConfigError(str(exc).replace(f"{name}: ", f"{name}: {source}, read as "
                                                        "config.yaml keys: ", 1)) from None
    if found:
        config = replace(config, versions=_served(config, folder, found))
    if not (config.inputs and config.outputs):
        config = _signature_from_artifact(config, artifact_folder(folder, config),
                                          "max_batch_size" in raw)
    return config


def _not_a_model(folder: Path, draft: EnsembleDraft) -> ConfigError:
    """Why the ensemble of ``folder`` is not loaded as a model: its plan's refusal over
    the step models as their folders hold them, or that it is an ensemble."""
    steps = {}
    for name in {step.model for step in draft.steps}:
        step = model_folder(folder.parent, name)
        try:
            if step is not None and is_model_folder(step) and ensemble_draft(step) is None:
                steps[name] = load_model_config(step)
        except Exception:  # a step that fails: the plan names it as not loaded
            continue
    try:
        plan_ensemble(draft, steps)
    except ConfigError as exc:
        return exc
    return ConfigError(f"{folder.name}: an ensemble is no model of its own: the API serves it "
                       "over its step models, read from its config.pbtxt when it starts")


def artifact_folder(folder: Path, config: ModelConfig, version: str = "") -> Path:
    """Where the artifact of ``version`` (the newest served when "") lies."""
    if not config.versions:
        return folder
    return folder / (version or config.versions[-1])


def _served(config: ModelConfig, folder: Path, found: list[int]) -> tuple[str, ...]:
    served = config.version_policy.choose(found)
    if not served:
        raise ConfigError(f"{config.name}: no version folder matches the version policy "
                          f"(folders: {', '.join(map(str, found))})")
    missing = [v for v in served if not (folder / str(v) / config.artifact).is_file()]
    if missing:
        raise ConfigError(f"{config.name}: version {missing[0]} has no {config.artifact}")
    return tuple(str(v) for v in served)


def _signature_from_artifact(config: ModelConfig, where: Path, batch_given: bool) -> ModelConfig:
    """Inputs and outputs the config leaves out, from the ONNX graph; a TorchScript or
    torch.export artifact records no names or shapes, so it must declare them."""
    if config.backend in ("torchscript", "torch_export"):
        raise ConfigError(f"{config.name}: a {config.backend} model needs its inputs and "
                          f"outputs declared (config.yaml or config.pbtxt): the artifact "
                          f"does not record tensor names, datatypes or shapes")
    if config.backend != "onnx":
        return config
    inputs, outputs = onnx_signature(where / config.artifact)
    config = replace(config, inputs=config.inputs or inputs, outputs=config.outputs or outputs)
    fixed = [t for t in (*inputs, *outputs) if not t.shape or t.shape[0] != -1]
    if not config.batched or not fixed:
        return config
    if batch_given:
        raise ConfigError(f"{config.name}: max_batch_size is {config.max_batch_size}, but the "
                          f"ONNX graph's {fixed[0].describe()} has no variable batch dim: set "
                          f"max_batch_size: 0, or export the graph with a dynamic first axis")
    log.info("%s: the ONNX graph's %s has a fixed first dim: served with max_batch_size 0 "
             "(each request alone, shapes as the graph's)", config.name, fixed[0].describe())
    return replace(config, max_batch_size=0)


@dataclass(frozen=True, slots=True)
class RepositoryScan:
    """What a scan of the repository found: the models that parse, and the ones that do
    not with the reason (one broken folder never hides the others)."""

    models: dict[str, ModelConfig] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    ensembles: dict[str, EnsemblePlan] = field(default_factory=dict)
    """Ensembles whose plan holds over the models loaded (no worker of their own)."""


def is_model_folder(folder: Path) -> bool:
    """A folder that holds an artifact, a ``config.yaml`` or ``config.pbtxt``, or a version
    folder with an artifact (hidden folders never do)."""
    return (folder.is_dir() and not folder.name.startswith(".")
            and (artifact_backend(folder) is not None or (folder / "config.yaml").exists()
                 or (folder / "config.pbtxt").exists()
                 or any(artifact_backend(folder / str(v)) for v in version_folders(folder))))


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
    drafts: dict[Path, EnsembleDraft] = {}
    for folder in model_folders(root):
        if only and folder.name not in only:
            continue
        try:
            draft = ensemble_draft(folder)
            if draft is None:
                scan.models[folder.name] = load_model_config(folder)
            else:
                drafts[folder] = draft
        except Exception as exc:  # one model's config never stops the others
            _failed(scan, folder, exc)
    for folder, draft in drafts.items():  # once every step model is known
        try:
            scan.ensembles[folder.name] = plan_ensemble(draft, scan.models)
        except ConfigError as exc:
            _failed(scan, folder, exc)
    return scan


def _failed(scan: RepositoryScan, folder: Path, exc: Exception) -> None:
    scan.failed[folder.name] = failure_reason(folder, exc)
    log.error("model %s is unavailable: %s", folder.name, scan.failed[folder.name])


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


def config_digest(config: dict[str, Any] | None) -> str:
    """A short digest of a load's configuration ("" for the folder's own): an inference
    process reports the one it runs, so a load waits for processes that run its own."""
    if config is None:
        return ""
    return hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def record_value(state: str, at: float, config: dict[str, Any] | None = None) -> bytes:
    """A repository hash value: ``{"state": "loaded"|"unloaded", "ts": epoch_s}``, and the
    ``config`` a load gave in place of the folder's (``config.yaml`` keys)."""
    value: dict[str, Any] = {"state": state, "ts": at}
    if config is not None:
        value["config"] = config
    return json.dumps(value).encode()


@dataclass(frozen=True, slots=True)
class Record:
    """A repository hash value read back; ``state`` is "" for a value that is not one."""

    state: str
    ts: float
    config: dict[str, Any] | None = None
    """The configuration a load gave in place of the folder's, if any."""


def parse_record(raw: bytes | str | None) -> Record:
    """Read a repository hash value; anything malformed (written by hand) reads as no
    state, so it is never acted on and never stops a reader."""
    try:
        value = json.loads(raw) if raw else {}
        state, ts = value.get("state"), float(value.get("ts", 0))
        config = value.get("config")
    except (ValueError, TypeError, AttributeError):
        return Record("", 0.0)
    if config is not None and not isinstance(config, dict):
        return Record("", 0.0)
    return Record(state if state in ("loaded", "unloaded") else "", ts, config)


def stale_entries(root: Path, names: Iterable[str]) -> list[str]:
    """Recorded names whose model no longer exists: an invalid name, or no folder under
    ``root`` (a folder that exists but fails to parse is kept)."""
    return sorted(n for n in names if model_folder(root, n) is None)


def status_table(rows: Iterable[tuple[str, str]],
                 versions: Mapping[str, Iterable[str]] | None = None) -> str:
    """Models and their states as Triton prints them at start: Model | Version | Status,
    a line per version of ``versions`` (model -> served versions; "1" when not there)."""
    served = versions or {}
    lines = [("Model", "Version", "Status"),
             *((m, v, s) for m, s in rows for v in served.get(m, ("1",)))]
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
            for line in lines]
    return "\n".join([rule, body[0], rule, *body[1:], rule])


def served_versions(models: Mapping[str, ModelConfig]) -> dict[str, tuple[str, ...]]:
    """Each model's served versions, for :func:`status_table`."""
    return {name: config.served_versions for name, config in models.items()}


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
