"""Triton's ``config.pbtxt`` read into the mapping a ``config.yaml`` holds.

The fields conveyor understands become ``config.yaml`` keys, which the same schema then
validates (:mod:`batching.config_schema`); a field it does not understand is refused by
name, with its line, never ignored: the model shows UNAVAILABLE with that reason.
docs/configuration.md has the table of fields.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from batching.config_schema import ConfigError
from batching.datatypes import DATATYPES
from batching.pbtxt import Message, PbtxtError, Value, message_from_json, parse_pbtxt

_BACKENDS = {"onnxruntime": "onnx", "pytorch": "torchscript", "python": "python"}
_PLATFORMS = {"onnxruntime_onnx": "onnx", "pytorch_libtorch": "torchscript",
              "pytorch_torch_export": "torch_export"}
_REFUSED = {
    "sequence_batching": "sequence batching (stateful models) is not supported",
    "ensemble_scheduling": "ensemble_scheduling needs platform: \"ensemble\"",
    "batch_input": "batch inputs (ragged batching) are not supported",
    "batch_output": "batch outputs (ragged batching) are not supported",
}
_TIMEOUT_US = "default_timeout_microseconds"
PBTXT = "config.pbtxt"
ENSEMBLE = "ensemble"
_MAPS = ("parameters", "priority_queue_policy")
"""ModelConfig's map fields (as Triton's JSON writes them: an object of key -> value)."""


class Fields:
    """One message's fields, read once each; :meth:`done` refuses any left unread."""

    def __init__(self, model: str, message: Message, where: str, source: str) -> None:
        self.model, self.message, self.where, self.source = model, message, where, source
        self._read: set[str] = set()
        self.loose = source != PBTXT
        """JSON: enum names are strings, and 64-bit integers may be too."""

    def error(self, line: int, text: str) -> ConfigError:
        at = f" line {line}" if line else ""
        return ConfigError(f"{self.model}: {self.source}{at}: {self.where}{text}")

    def values(self, name: str) -> list[Value]:
        self._read.add(name)
        return self.message.fields.get(name, [])

    def one(self, name: str) -> Value | None:
        values = self.values(name)
        if len(values) > 1:
            raise self.error(values[1].line, f"{name} is given more than once")
        return values[0] if values else None

    def string(self, name: str) -> str | None:
        value = self.one(name)
        if value is None:
            return None
        if value.kind != "string":
            raise self.error(value.line, f"{name} must be a quoted string")
        return value.text

    def integer(self, name: str) -> int | None:
        value = self.one(name)
        return None if value is None else self.as_int(name, value)

    def as_int(self, name: str, value: Value) -> int:
        """An integer; JSON writes 64-bit ones as strings."""
        json_int = self.loose and value.kind == "string" and re.fullmatch(r"-?\d+", value.text)
        number = value.number() if value.kind == "number" or json_int else None
        if not isinstance(number, int):
            raise self.error(value.line, f"{name} must be an integer, got {value.text!r}")
        return number

    def integers(self, name: str) -> list[int]:
        return [self.as_int(name, value) for value in self.values(name)]

    def flag(self, name: str) -> bool | None:
        value = self.one(name)
        if value is None:
            return None
        if value.kind != "ident" or value.text not in ("true", "false"):
            raise self.error(value.line, f"{name} must be true or false")
        return value.text == "true"

    def enum(self, name: str, allowed: tuple[str, ...]) -> str | None:
        value = self.one(name)
        if value is None:
            return None
        if value.kind not in self.names() or value.text not in allowed:
            raise self.error(value.line, f"{name} {value.text!r} is not supported (conveyor "
                                         f"understands {', '.join(allowed)})")
        return value.text

    def names(self) -> tuple[str, ...]:
        """The kinds of value an enum's name may be."""
        return ("ident", "string") if self.loose else ("ident",)

    def messages(self, name: str) -> list[Fields]:
        found = []
        for value in self.values(name):
            if value.message is None:
                raise self.error(value.line, f"{name} must be a message {{ ... }}")
            found.append(Fields(self.model, value.message, f"{self.where}{name}: ",
                                 self.source))
        return found

    def sub(self, name: str) -> Fields | None:
        found = self.messages(name)
        if len(found) > 1:
            raise self.error(found[1].message.line, f"{name} is given more than once")
        return found[0] if found else None

    def done(self) -> None:
        for name, values in self.message.fields.items():
            if name not in self._read:
                reason = _REFUSED.get(name, f"{name} is not supported by conveyor")
                raise self.error(values[0].line, reason)


def pbtxt_fields(model: str, text: bytes) -> Fields:
    """The top message of ``config.pbtxt`` (its bytes), parsed, its fields to read."""
    try:
        root = parse_pbtxt(text.decode())
    except UnicodeDecodeError:
        raise ConfigError(f"{model}: config.pbtxt is not UTF-8 text") from None
    except PbtxtError as exc:
        raise ConfigError(f"{model}: config.pbtxt {exc}") from None
    return Fields(model, root, "", PBTXT)


def is_ensemble(top: Fields) -> bool:
    """Whether the configuration says ``platform: "ensemble"`` (batching/ensemble.py)."""
    platform = top.message.fields.get("platform", [])
    return bool(platform) and platform[0].text == ENSEMBLE


def pbtxt_config(model: str, text: bytes) -> dict[str, Any]:
    """The ``config.yaml`` mapping that ``config.pbtxt`` (its bytes) says."""
    return _convert(pbtxt_fields(model, text))


def json_config(model: str, text: str) -> dict[str, Any]:
    """The ``config.yaml`` mapping that a ModelConfig in Triton's JSON form says (the
    ``config`` parameter of a repository load)."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        raise ConfigError(f"{model}: the load's config is not JSON") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{model}: the load's config must be a JSON object")
    try:
        root = message_from_json(document, _MAPS)
    except RecursionError:
        raise ConfigError(f"{model}: the load's config nests too deeply") from None
    return _convert(Fields(model, root, "", "the load's config"))


def _convert(top: Fields) -> dict[str, Any]:
    root = top.message
    model = top.model
    if is_ensemble(top):
        raise top.error(root.line, "an ensemble is no model of its own: the API serves it "
                                   "over its step models, read from its config.pbtxt when it "
                                   "starts (a repository load cannot give one)")
    raw: dict[str, Any] = {}
    name = top.string("name")
    if name is not None and name != model:
        raise top.error(root.line, f"name {name!r} is not the model folder's name {model!r}")
    backend = _backend(top)
    if backend:
        raw["backend"] = backend
    raw["max_batch_size"] = top.integer("max_batch_size") or 0
    batched = raw["max_batch_size"] > 0
    for key, field in (("inputs", "input"), ("outputs", "output")):
        tensors = [tensor_entry(t, batched) for t in top.messages(field)]
        if tensors:
            raw[key] = tensors
    _transaction_policy(top)
    batching = top.sub("dynamic_batching")
    if batching is not None:
        _dynamic_batching(batching, raw)
    # Triton does not wait for a fuller batch unless told to: conveyor's adaptive bound
    # (ADAPTIVE_BOUND_US) applies to config.yaml only, never to a Triton configuration.
    raw.setdefault("batching", {}).setdefault("max_queue_delay_us", 0)
    groups = top.messages("instance_group")
    if groups:
        raw["instances"] = [group for fields in groups for group in _instance_group(fields)]
    policy = top.sub("version_policy")
    if policy is not None:
        raw["version_policy"] = _version_policy(policy)
    filename = top.string("default_model_filename")
    if filename:
        raw["model_filename"] = filename
    _parameters(top, raw)
    top.done()
    return raw


def _backend(top: Fields) -> str | None:
    platform, backend = top.string("platform"), top.string("backend")
    chosen = []
    for field_name, value, known in (("platform", platform, _PLATFORMS),
                                     ("backend", backend, _BACKENDS)):
        if not value:
            continue
        if value not in known:
            raise top.error(top.one(field_name).line,  # type: ignore[union-attr]
                            f"{field_name} {value!r} is not supported (conveyor serves "
                            f"{', '.join(sorted(known))})")
        chosen.append(known[value])
    if chosen == ["torch_export", "torchscript"]:  # conveyor's own /config: backend "pytorch"
        chosen = ["torch_export"]
    if len(set(chosen)) > 1:
        raise top.error(top.message.line, f"platform {platform!r} and backend {backend!r} "
                                          "disagree")
    return chosen[0] if chosen else None


def tensor_entry(fields: Fields, batched: bool) -> dict[str, Any]:
    name = fields.string("name")
    if not name:
        raise fields.error(fields.message.line, "name is required")
    fields.where += f"{name!r}: "
    data_type = fields.one("data_type")
    if data_type is None:
        raise fields.error(fields.message.line, "data_type is required")
    datatype = "BYTES" if data_type.text == "TYPE_STRING" else data_type.text[5:]
    if data_type.kind not in fields.names() or not data_type.text.startswith("TYPE_") \
            or datatype not in DATATYPES:
        raise fields.error(data_type.line, f"data_type {data_type.text!r} is not supported")
    dims = fields.integers("dims")
    if not dims and not batched:
        raise fields.error(fields.message.line, "dims must not be empty when "
                                                "max_batch_size is 0")
    reshape = fields.sub("reshape")
    target = None
    if reshape is not None:
        target = reshape.integers("shape")
        reshape.done()
    fields.enum("format", ("FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW"))
    for flag in ("optional", "is_shape_tensor", "allow_ragged_batch", "is_non_linear_format_io"):
        if fields.flag(flag):
            raise fields.error(fields.message.line, f"{flag}: true is not supported")
    fields.done()
    tensor = {"name": name, "datatype": datatype, "shape": ([-1] if batched else []) + dims}
    if target is not None and target != dims:
        tensor["reshape"] = target
    return tensor


def _transaction_policy(top: Fields) -> None:
    policy = top.sub("model_transaction_policy")
    if policy is not None:
        if policy.flag("decoupled"):
            raise policy.error(policy.message.line, "decoupled models (several responses "
                                                    "per request) are not supported")
        policy.done()


def _dynamic_batching(fields: Fields, raw: dict[str, Any]) -> None:
    batching: dict[str, Any] = {}
    queue: dict[str, Any] = {}
    delay = fields.integer("max_queue_delay_microseconds")
    if delay is not None:
        batching["max_queue_delay_us"] = delay
    preferred = fields.integers("preferred_batch_size")
    if preferred:
        batching["preferred_batch_sizes"] = preferred
    if fields.flag("preserve_ordering"):
        raise fields.error(fields.message.line, "preserve_ordering: true is not supported "
                                                "(conveyor answers each request as it is done)")
    levels = fields.integer("priority_levels")
    if levels:
        queue["priority_levels"] = levels
        queue["default_priority"] = fields.integer("default_priority_level") or 0
        if not queue["default_priority"]:
            raise fields.error(fields.message.line, "default_priority_level is required with "
                                                    "priority_levels")
    elif fields.integer("default_priority_level"):
        raise fields.error(fields.message.line, "default_priority_level needs priority_levels")
    default = fields.sub("default_queue_policy")
    policy = _queue_policy(default) if default is not None else {}
    for entry in fields.messages("priority_queue_policy"):
        value = entry.sub("value")
        entry.integer("key")
        entry.done()
        if value is None or _queue_policy(value) != policy:
            raise entry.error(entry.message.line, "a priority level's own queue policy is not "
                                                  "supported: give every level the "
                                                  "default_queue_policy")
    queue.update(policy)
    if batching:
        raw["batching"] = batching
    if queue:
        raw["queue"] = queue
    fields.done()


def _queue_policy(fields: Fields) -> dict[str, Any]:
    """``default_queue_policy`` as ``queue`` keys (0 means unset, as in Triton)."""
    fields.enum("timeout_action", ("REJECT",))
    fields.flag("allow_timeout_override")  # conveyor always lets a request shorten it
    policy: dict[str, Any] = {}
    timeout_us = fields.integer(_TIMEOUT_US)
    if timeout_us:
        policy["default_timeout_ms"] = max(1, math.ceil(timeout_us / 1000))
    size = fields.integer("max_queue_size")
    if size:
        policy["max_queue_rows"] = size
    fields.done()
    return policy


def _instance_group(fields: Fields) -> list[dict[str, Any]]:
    count = fields.integer("count")
    count = 1 if count is None else count
    kind = fields.enum("kind", ("KIND_AUTO", "KIND_CPU", "KIND_GPU")) or "KIND_AUTO"
    gpus = fields.integers("gpus")
    fields.string("name")
    fields.done()
    if kind == "KIND_GPU":
        return [{"device": f"cuda:{gpu}", "count": count} for gpu in gpus] or [
            {"device": "cuda", "count": count}]
    if gpus:
        raise fields.error(fields.message.line, f"gpus needs kind: KIND_GPU, not {kind}")
    return [{"device": "cpu", "count": count}]


def _version_policy(fields: Fields) -> dict[str, Any]:
    latest, every, specific = fields.sub("latest"), fields.sub("all"), fields.sub("specific")
    given = [p for p in (latest, every, specific) if p is not None]
    if len(given) != 1:
        raise fields.error(fields.message.line, "give exactly one of latest, all, specific")
    fields.done()
    if latest is not None:
        num = latest.integer("num_versions")
        latest.done()
        return {"latest": 1 if num is None else num}
    if specific is not None:
        versions = specific.integers("versions")
        specific.done()
        return {"specific": versions}
    assert every is not None
    every.done()
    return {"all": True}


_CONVEYOR: dict[str, tuple[str, Callable[[str], Any]]] = {
    "conveyor.adaptive": ("batching.adaptive", lambda text: {"true": True, "false": False}[text]),
    "conveyor.latency_target_ms": ("batching.latency_target_ms", float),
    "conveyor.execution_timeout_s": ("execution_timeout_s", float),
    "conveyor.max_priority_wait_ms": ("queue.max_priority_wait_ms", int),
}


def _parameters(top: Fields, raw: dict[str, Any]) -> None:
    """``parameters``: ``conveyor.*`` keys set conveyor's own knobs; the others go to the
    model as ``parameters`` (string values, as Triton passes them)."""
    parameters: dict[str, str] = {}
    for entry in top.messages("parameters"):
        key = entry.string("key")
        value = entry.sub("value")
        entry.done()
        if not key or value is None:
            raise entry.error(entry.message.line, "a parameter needs a key and a value")
        text = value.string("string_value")
        value.done()
        if text is None:
            raise value.error(value.message.line, "string_value is required")
        if key in _CONVEYOR:
            path, convert = _CONVEYOR[key]
            try:
                converted = convert(text)
            except (KeyError, ValueError):
                raise entry.error(entry.message.line,
                                  f"{key} {text!r} is not a valid value") from None
            section, _, leaf = path.rpartition(".")
            (raw.setdefault(section, {}) if section else raw)[leaf] = converted
        else:
            parameters[key] = text
    if parameters:
        raw["parameters"] = parameters
