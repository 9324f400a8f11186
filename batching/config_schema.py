"""Validation of a ``config.yaml`` (read by :mod:`batching.config_yaml`): strict pydantic
models of its keys, then the checks that span keys. Every failure is one
:class:`ConfigError` naming the model folder, the key path (``queue.priority_levels``,
``inputs[0].shape``) and the reason; nothing is coerced, so a quoted number or a boolean
where an integer belongs is refused."""

from __future__ import annotations

import difflib
import math
import re
import reprlib
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

from batching.datatypes import DATATYPES, to_numpy

BACKENDS = {"torchscript": "model.pt", "torch_export": "model.pt2", "onnx": "model.onnx",
            "python": "model.py"}
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MAX = 2**63 - 1
MAX_PRIORITY_LEVELS = 64
MAX_PARTITIONS = 256
"""``queue.partitions`` at most: a Redis Cluster has 16,384 slots, and every read of an
inference process touches each partition."""
_MAX_ISSUES = 5
_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")
THREADED_BACKENDS = {"torchscript", "torch_export", "onnx"}
"""Backends that read ``cpu_threads`` and ``parameters.threads``."""


class ConfigError(ValueError):
    """A ``config.yaml`` that cannot be served; the message names the folder, key and reason."""


def _datatype(value: str) -> str:
    if value not in DATATYPES:
        raise PydanticCustomError("datatype", "must be one of " + ", ".join(sorted(DATATYPES)))
    return value


def _dim(value: int) -> int:
    if value != -1 and value < 1:
        raise PydanticCustomError("dim", "must be -1 (any size) or a positive integer")
    return value


def _backend(value: str) -> str:
    if value not in BACKENDS:
        raise PydanticCustomError("backend", "must be one of " + ", ".join(sorted(BACKENDS)))
    return value


def _device(value: str) -> str:
    if not _DEVICE.fullmatch(value):
        raise PydanticCustomError("device", "must be cpu, cuda or cuda:<index>")
    return value


_Number = Annotated[float, Field(allow_inf_nan=False)]
_Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PadSchema(_Section):
    axis: int
    value: float = 0.0


class TensorSchema(_Section):
    name: Annotated[str, Field(min_length=1)]
    datatype: Annotated[str, AfterValidator(_datatype)]
    shape: Annotated[list[Annotated[int, Field(le=INT64_MAX), AfterValidator(_dim)]],
                     Field(min_length=1)]
    pad: PadSchema | None = None
    reshape: list[Annotated[int, Field(ge=1, le=INT64_MAX)]] | None = None
    """The shape (less the batch dim) the model takes or gives, when not ``shape``'s."""


class BatchingSchema(_Section):
    max_queue_delay_us: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    """None: ``ADAPTIVE_BOUND_US`` for the adaptive policy, 0 for a fixed window."""
    preferred_batch_sizes: list[Annotated[int, Field(ge=1, le=INT32_MAX)]] = []
    latency_target_ms: _Positive = 50.0
    adaptive: bool = True
    overload: Literal["lifo", "fifo"] | None = None
    """None: ``lifo`` where ``latency_target_ms`` is set, else ``fifo`` (:func:`overload`)."""


class QueueSchema(_Section):
    priority_levels: Annotated[int, Field(ge=1, le=MAX_PRIORITY_LEVELS)] = 3
    default_priority: Annotated[int, Field(ge=1)] = 2
    max_queue_rows: Annotated[int, Field(ge=1, le=UINT32_MAX)] = 10000
    default_timeout_ms: Annotated[int, Field(ge=1, le=INT64_MAX // 1000)] = 30000
    max_priority_wait_ms: Annotated[int, Field(ge=1, le=INT64_MAX // 1000)] | None = None
    """Priority aging: a request of a level below 1 queued this long goes ahead of every
    level. None: strict priority, as in Triton."""
    partitions: Annotated[int, Field(ge=1, le=MAX_PARTITIONS)] = 1
    """Sets of streams and counters (hash slots) one model's requests spread over."""


class InstanceSchema(_Section):
    device: Annotated[str, AfterValidator(_device)] = "cpu"
    count: Annotated[int, Field(ge=1, le=INT32_MAX)] = 1


class CpuThreadsSchema(_Section):
    """CPU threads of each inference process; an unset ``intra_op`` is derived from the
    cores when the model loads (``workers/backends.py``)."""

    intra_op: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    inter_op: Annotated[int, Field(ge=1, le=INT32_MAX)] = 1
    spin: bool = False


class VersionPolicySchema(_Section):
    """Which version folders are served: the newest ``latest``, ``all``, or ``specific``."""

    latest: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    all: bool | None = None
    specific: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None


def _filename(value: str) -> str:
    if not value or "/" in value or "\\" in value or value in (".", ".."):
        raise PydanticCustomError("filename", "must be a file name, with no folder in it")
    return value


class ConfigSchema(_Section):
    backend: Annotated[str, AfterValidator(_backend)] | None = None
    max_batch_size: Annotated[int, Field(ge=0, le=INT32_MAX)] = 64
    """0: the model has no batch dim; each request runs alone, its shapes as given."""
    inputs: list[TensorSchema] | None = None
    outputs: list[TensorSchema] | None = None
    batching: BatchingSchema | None = None
    queue: QueueSchema | None = None
    execution_timeout_s: _Positive = 60.0
    max_deliveries: Annotated[int, Field(ge=1, le=INT64_MAX)] = 3
    max_batch_cost: _Positive | None = None
    instances: list[InstanceSchema] | None = None
    cpu_threads: CpuThreadsSchema | None = None
    parameters: dict[str, Any] | None = None
    version_policy: VersionPolicySchema | None = None
    model_filename: Annotated[str, AfterValidator(_filename)] | None = None
    """The artifact's file name, when not the backend's (``default_model_filename``)."""
    platform: str | None = None
    """Accepted for compatibility with Triton's configs, and ignored."""


_SECTIONS: dict[tuple[str, ...], type[BaseModel]] = {
    (): ConfigSchema, ("batching",): BatchingSchema, ("queue",): QueueSchema,
    ("instances",): InstanceSchema, ("cpu_threads",): CpuThreadsSchema,
    ("inputs",): TensorSchema, ("outputs",): TensorSchema,
    ("inputs", "pad"): PadSchema, ("outputs", "pad"): PadSchema,
    ("version_policy",): VersionPolicySchema,
}


def parse_config(model: str, raw: Any, artifact: str | None) -> tuple[ConfigSchema, str]:
    """The validated keys of ``raw`` and the backend: its ``backend`` key, else ``artifact``
    (the backend of the artifact found in the folder)."""
    try:
        schema = ConfigSchema.model_validate(raw)
    except ValidationError as exc:
        raise _error(model, [_describe(error) for error in exc.errors()]) from None
    backend = schema.backend or artifact
    if backend not in BACKENDS:
        raise _error(model, ["backend must be one of " + ", ".join(sorted(BACKENDS))
                             + " (no backend key and no model artifact in the folder)"])
    problems = _cross_checks(schema, backend)
    if problems:
        raise _error(model, problems)
    return schema, backend


def _error(model: str, problems: list[str]) -> ConfigError:
    shown = problems[:_MAX_ISSUES]
    more = len(problems) - len(shown)
    return ConfigError(f"{model}: " + "; ".join(shown) + (f"; and {more} more" if more else ""))


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _describe(error: ErrorDetails) -> str:
    loc, kind, value = tuple(error["loc"]), error["type"], error["input"]
    if kind in ("extra_forbidden", "invalid_key"):
        return _unknown_key(loc)
    if loc[-1:] == ("[key]",):
        return f"{_path(loc[:-2])} has a key {short_repr(loc[-2])} that is not a string"
    where = _path(loc) or "config.yaml"
    if kind == "missing":
        return f"{where} is required"
    return f"{where} {_reason(error)}, got {short_repr(value)}{_hint(kind, value)}"


def _unknown_key(loc: tuple[int | str, ...]) -> str:
    key, parent = loc[-1], loc[:-1]
    section = _SECTIONS.get(tuple(p for p in parent if isinstance(p, str)))
    where = f" in {_path(parent)}" if parent else ""
    known = sorted(section.model_fields) if section else []
    close = difflib.get_close_matches(str(key), known, n=1)
    if close:
        return f"unknown key {short_repr(key)}{where} (did you mean {close[0]!r}?)"
    return f"unknown key {short_repr(key)}{where} (known keys: {', '.join(known)})"


def _reason(error: ErrorDetails) -> str:
    kind, ctx = error["type"], error.get("ctx", {})
    fixed = {"int_type": "must be an integer", "float_type": "must be a number",
             "bool_type": "must be true or false", "string_type": "must be a string",
             "list_type": "must be a list", "dict_type": "must be a mapping",
             "model_type": "must be a mapping", "finite_number": "must be a finite number"}
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<="}
    if kind in fixed:
        return fixed[kind]
    if kind in bounds:
        limit = ctx["ge" if kind == "greater_than_equal" else "gt" if kind == "greater_than"
                    else "le"]
        return f"must be {bounds[kind]} {limit if isinstance(limit, int) else f'{limit:g}'}"
    if kind in ("too_short", "string_too_short"):
        return "must not be empty"
    message = error["msg"].replace("Input should be", "must be")
    return message[:1].lower() + message[1:]


def _hint(kind: str, value: Any) -> str:
    if kind in ("int_type", "float_type") and isinstance(value, str) and _numeric(value):
        return " (a quoted string: write the number without quotes)"
    if kind in ("int_type", "float_type") and isinstance(value, bool):
        return " (a boolean)"
    return ""


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = 4
_REPR.maxlevel = 2


def short_repr(value: Any) -> str:
    """A value as an error message shows it: at most 60 characters, 4 items, 2 levels."""
    return _REPR.repr(value)


def kind_of(value: Any) -> str:
    """What a YAML value is, in words ("a list", "an integer"...)."""
    return {list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}.get(type(value), type(value).__name__)


def _cross_checks(schema: ConfigSchema, backend: str) -> list[str]:
    problems: list[str] = []
    queue = schema.queue or QueueSchema()
    if not queue.default_priority <= queue.priority_levels:
        problems.append(f"queue.default_priority must be within 1..priority_levels "
                        f"({queue.priority_levels}), got {queue.default_priority}")
    share = -(-queue.max_queue_rows // queue.partitions)
    if queue.partitions > 1 and share < max(schema.max_batch_size, 1):
        problems.append(f"queue.partitions: each of the {queue.partitions} partitions holds "
                        f"{share} rows of max_queue_rows ({queue.max_queue_rows}), fewer than "
                        f"one request may carry (max_batch_size {schema.max_batch_size})")
    for key in ("inputs", "outputs"):
        problems += _tensor_checks(key, getattr(schema, key) or [], schema.max_batch_size > 0)
    problems += _thread_checks(schema, backend)
    policy = schema.version_policy
    if policy is not None and sum(p is not None for p in (policy.latest, policy.all,
                                                         policy.specific)) != 1:
        problems.append("version_policy must give exactly one of latest, all, specific")
    elif policy is not None and policy.all is False:
        problems.append("version_policy.all must be true (or give latest or specific)")
    return problems


def _thread_checks(schema: ConfigSchema, backend: str) -> list[str]:
    """``cpu_threads`` and its older spelling ``parameters.threads`` (intra-op threads only)."""
    problems: list[str] = []
    cpu = schema.cpu_threads
    if cpu is not None and backend not in THREADED_BACKENDS:
        problems.append(f"cpu_threads applies to the {', '.join(sorted(THREADED_BACKENDS))} backends, "
                        f"not {backend} (a python model reads its own parameters)")
    elif cpu is not None and cpu.spin and backend != "onnx":
        problems.append("cpu_threads.spin: true applies to the onnx backend only (torch's "
                        "thread pool does not take it)")
    if backend not in THREADED_BACKENDS or "threads" not in (schema.parameters or {}):
        return problems
    threads = (schema.parameters or {})["threads"]
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        problems.append(f"parameters.threads must be an integer >= 1, got {short_repr(threads)}")
    elif cpu is not None and cpu.intra_op is not None:
        problems.append("parameters.threads and cpu_threads.intra_op both set the intra-op "
                        "threads: keep cpu_threads.intra_op")
    return problems


def intra_op_threads(schema: ConfigSchema, backend: str) -> int | None:
    """The configured intra-op threads (``cpu_threads.intra_op``, else ``parameters.threads``
    of a backend that reads it), or None: derive them from the cores."""
    if schema.cpu_threads is not None and schema.cpu_threads.intra_op is not None:
        return schema.cpu_threads.intra_op
    threads = (schema.parameters or {}).get("threads") if backend in THREADED_BACKENDS else None
    return threads if isinstance(threads, int) else None


def _tensor_checks(key: str, tensors: list[TensorSchema], batched: bool) -> list[str]:
    problems: list[str] = []
    seen: dict[str, int] = {}
    for i, tensor in enumerate(tensors):
        where = f"{key}[{i}]"
        if tensor.name in seen:
            problems.append(f"{where}.name {tensor.name!r} is also {key}[{seen[tensor.name]}]'s")
        seen.setdefault(tensor.name, i)
        if tensor.reshape is not None:
            problems += _reshape_checks(where, tensor, batched)
        pad = tensor.pad
        if pad is None:
            continue
        if not batched:
            problems.append(f"{where}.pad needs a batch dim (max_batch_size: 0 runs each "
                            "request alone)")
            continue
        if not 1 <= pad.axis < len(tensor.shape) or tensor.shape[pad.axis] != -1:
            problems.append(f"{where}.pad.axis must name a variable (-1) axis after the batch "
                            f"dim of shape {tensor.shape}, got {pad.axis}")
        if key == "inputs" and not _fits(tensor.datatype, pad.value):
            problems.append(f"{where}.pad.value {pad.value:g} does not fit {tensor.datatype}")
    return problems


def _reshape_checks(where: str, tensor: TensorSchema, batched: bool) -> list[str]:
    dims = tensor.shape[1:] if batched else tensor.shape
    if -1 in dims or tensor.pad is not None:
        return [f"{where}.reshape needs fixed dims (no -1, no pad), got {tensor.shape}"]
    if math.prod(dims) != math.prod(tensor.reshape or []):
        return [f"{where}.reshape {tensor.reshape} does not hold the {math.prod(dims)} "
                f"elements of {dims}"]
    return []


def _fits(datatype: str, value: float) -> bool:
    """Whether ``value`` pads a ``datatype`` tensor as itself (no wrap-around, no rounding)."""
    dtype = to_numpy(datatype)
    if dtype.kind == "b":
        return value in (0, 1)
    if dtype.kind in "iu":
        bits = 8 * dtype.itemsize - (dtype.kind == "i")
        low = -(2**bits) if dtype.kind == "i" else 0
        return math.isfinite(value) and value == int(value) and low <= value < 2**bits
    return True
