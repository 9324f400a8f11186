"""KServe v2 inference bodies over HTTP <-> tensors. No pydantic here: this is the infer hot path.

A request body is a JSON header, optionally followed by raw tensors (the binary tensor
extension, see :mod:`api.binary`): an input carries either ``data`` (JSON) or
``parameters.binary_data_size`` (its bytes come next in the body, in input order).
Outputs come back as JSON ``data`` or, when the request asks for it, as raw bytes after
the JSON header, rendered straight from the reply's raw tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from api.binary import tensor_from_buffer
from api.shm_params import ShmRef, tensor_ref
from batching.config import ModelConfig
from batching.datatypes import to_numpy
from batching.envelope import Tensor
from batching.errors import InvalidInput, MalformedShape
from batching.signature import INT64_MAX, check_dims, check_inputs, dims

MAX_JSON_DEPTH = 100
"""Deepest nesting of an input's JSON ``data`` (Triton's limit)."""

Vet = Callable[[dict[str, Any]], None]
"""Called with a request's ``parameters`` once they are known and before its tensors are
decoded; raises to refuse the request (the API's overload check, api/overload.py)."""


@dataclass(slots=True)
class InferRequest:
    """A parsed request of any protocol, validated against the model's signature."""

    id: str | None
    inputs: list[Tensor]
    rows: int
    outputs: list[str] = field(default_factory=list)
    """Output names asked for; empty means every output."""
    parameters: dict[str, Any] = field(default_factory=dict)
    binary_default: bool = False
    """HTTP: render the outputs as binary when the request lists none (``binary_data_output``)."""
    binary_outputs: dict[str, bool] = field(default_factory=dict)
    """HTTP: the listed outputs' ``binary_data`` flags."""
    shm_inputs: dict[int, ShmRef] = field(default_factory=dict)
    """Inputs (by index) whose bytes lie in a shared memory region; their tensors hold no
    data until :meth:`api.shared_memory.SharedMemory.bind` reads it."""
    shm_outputs: dict[str, ShmRef] = field(default_factory=dict)
    """Outputs to write into a shared memory region; the response carries no data for them."""
    version: str = "1"
    """The model version that answers (set by the service once the model is known)."""

    def binary(self, output: str) -> bool:
        """A listed output is binary only when it says so itself, whatever
        ``binary_data_output`` says (as Triton does); unlisted ones follow the request."""
        if self.outputs:
            return self.binary_outputs.get(output, False)
        return self.binary_default


def json_object(data: bytes | memoryview) -> dict[str, Any]:
    """A request body that must be one JSON object; anything else is a 400."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("request body must be a JSON object")
    return doc


def parse_header(header: bytes | memoryview, binary: memoryview, config: ModelConfig,
                 vet: Vet | None = None) -> InferRequest:
    """A JSON header and the binary tensor section that followed it (possibly empty)."""
    return parse_document(json_object(header), binary, config, vet)


def parse_document(doc: dict[str, Any], binary: memoryview, config: ModelConfig,
                   vet: Vet | None = None) -> InferRequest:
    """:func:`parse_header` of a header already parsed as JSON."""
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("'inputs' must be a non-empty list of tensors")
    params = doc.get("parameters") or {}
    if vet is not None and isinstance(params, dict):
        vet(params)  # decoding the tensors is most of a parse: a request refused here skips it
    heads = [_head(i, item) for i, item in enumerate(raw_inputs)]
    # Triton's order: the body (JSON data, binary sections) first, then the signature,
    # then the binary sizes; its clients and tests see whichever error comes first.
    parts: list[Tensor | memoryview] = []
    offset = 0
    shm_inputs = {}
    for index, ((name, datatype, shape, size, ref), item) in enumerate(zip(heads, raw_inputs,
                                                                           strict=True)):
        if ref is not None:
            shm_inputs[index] = ref
            parts.append(Tensor(name, datatype, shape, b""))
            continue
        if size is None:
            parts.append(_json_tensor(name, datatype, shape, item["data"]))
            continue
        if offset + size > len(binary):
            raise InvalidInput(f"unexpected size for input '{name}', expecting "
                               f"{offset + size - len(binary)} additional bytes for model "
                               f"'{config.name}'")
        parts.append(binary[offset:offset + size])
        offset += size
    if offset != len(binary):
        raise InvalidInput(f"unexpected additional input data for model '{config.name}' "
                           f"({len(binary) - offset} bytes that no input's binary_data_size "
                           "accounts for)")
    rows = check_inputs(config, [(name, datatype, shape) for name, datatype, shape, _, _ in heads])
    tensors = [part if isinstance(part, Tensor) else
               tensor_from_buffer(name, datatype, shape, part, config.name)
               for (name, datatype, shape, _, _), part in zip(heads, parts, strict=True)]
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be an object")
    names, flags, shm_outputs = _wanted_outputs(doc.get("outputs"))
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise InvalidInput(f"'id' must be a string, got {type(rid).__name__}")
    return InferRequest(
        id=rid,
        inputs=tensors,
        rows=rows,
        outputs=check_outputs(names, config),
        parameters=params,
        binary_default=params.get("binary_data_output") is True,
        binary_outputs=flags,
        shm_inputs=shm_inputs,
        shm_outputs=shm_outputs,
    )


def _head(index: int, item: Any) -> tuple[str, str, tuple[int, ...], int | None, ShmRef | None]:
    """(name, datatype, shape, binary_data_size or None, the region holding the data or
    None): the data is JSON when both are None."""
    if not isinstance(item, dict):
        raise InvalidInput(f"inputs[{index}] must be an object")
    name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
    if not isinstance(name, str):
        raise InvalidInput(f"inputs[{index}]: 'name' must be a string")
    if not isinstance(datatype, str):
        raise InvalidInput(f"input {name!r}: 'datatype' must be a string")
    dtype = to_numpy(datatype)
    if not isinstance(shape, list):
        raise InvalidInput(f"Unable to parse 'shape': input {name!r}: 'shape' must be a list")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise MalformedShape("Unable to parse 'shape': attempt to access JSON "
                             "non-unsigned-integer as unsigned-integer")
    check_dims(name, shape)  # beside a zero one, a huge dimension passes the count
    count = math.prod(shape)
    if count > INT64_MAX:
        raise InvalidInput(f"invalid shape for input '{name}': shape {dims(shape)} causes "
                           f"total element count to exceed maximum size of {INT64_MAX}")
    params = item.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput(f"input {name!r}: 'parameters' must be an object")
    reject_unsupported(f"input {name!r}", params)
    size = params.get("binary_data_size")
    ref = tensor_ref(name, params)
    if ref is not None:
        if "data" in item or size is not None:
            given = " ".join(f"'{k}'" for k, present in (("data", "data" in item),
                             ("binary_data_size", size is not None)) if present)
            raise InvalidInput(
                "Input must set only one of the following fields: 'data', 'binary_data_size' "
                "in 'parameters', 'shared_memory_region' in 'parameters'. But set "
                f"{given} 'shared_memory_region'")
        return name, datatype, tuple(shape), None, ref
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInput(f"input {name!r}: binary_data_size must be a non-negative integer")
        if "data" in item:
            raise InvalidInput(f"input {name!r} has both 'data' and binary_data_size")
    elif "data" not in item:
        raise InvalidInput(f"input {name!r}: 'data' is missing")
    elif datatype != "BYTES" and count * dtype.itemsize > INT64_MAX:
        raise InvalidInput(f"byte size overflow for input '{name}': element count ({count}) "
                           f"* data type size ({dtype.itemsize}) exceeds maximum allowed size "
                           f"({INT64_MAX})")
    return name, datatype, tuple(shape), size, None


def _json_tensor(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> Tensor:
    count = math.prod(shape)
    nested = data
    for _ in range(MAX_JSON_DEPTH):
        if not isinstance(nested, list) or not nested:
            break
        nested = nested[0]
    else:
        raise InvalidInput("Unable to parse 'data': JSON nesting depth exceeds maximum "
                           f"allowed limit ({MAX_JSON_DEPTH})")
    try:
        if datatype == "BYTES":
            flat = np.asarray(data, dtype=np.object_).reshape(-1)
            array = np.array([v.encode() if isinstance(v, str) else v for v in flat],
                             dtype=np.object_)
            if not all(isinstance(v, bytes) for v in array):
                raise TypeError("BYTES elements must be strings")
        else:
            array = json_numbers(data, to_numpy(datatype))
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(f"input {name!r}: data is not {datatype}: {exc}") from None
    if array.size < count:
        raise InvalidInput("Failed to parse 'data' field: shape does not match true shape")
    if array.size > count:
        raise InvalidInput("Unable to parse 'data': Shape does not match true shape of "
                           "'data' field")
    return Tensor.from_array(name, array.reshape(shape), datatype)


_JSON_TYPES: dict[str, tuple[frozenset[type], str]] = {
    "b": (frozenset({bool}), "true/false"),
    "i": (frozenset({int}), "integers"),
    "u": (frozenset({int}), "integers"),
    "f": (frozenset({int, float}), "numbers"),
}
"""The JSON values each kind of datatype takes (v2 is strict: no null, strings or bools
among numbers, no fractions for integer types), and their name for error messages."""
_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}
"""The same, as numpy kinds of an array numpy reads from nested lists."""
_SCAN_MAX = 256
"""A flat list of at most this many numbers has the type of each element checked, then
numpy converts it straight to the target dtype: the cheapest way for short lists. So has a
flat list of any length for integer types and BOOL (numpy reads integers without a dtype
at half the speed, and lists of 0 and 1 are common there). Longer float lists and nested
lists are read by numpy first, as they are."""


def json_numbers(data: Any, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """JSON ``data`` (flat or nested lists) as an array of ``dtype``, strictly as v2 asks.

    A list whose element types are checked (``_SCAN_MAX``) must hold only the JSON type
    of the datatype. Anything else is read by numpy as it is: null, strings and mixtures
    turn into an object or string array, and fractions into a float one, all refused where
    they do not fit; a bool among numbers would read as 0 or 1, so the elements that read
    as 0 or 1 have their types checked. Numbers must fit the type: an integer its range,
    a number for FP16 or FP32 its largest finite value (numpy would make it infinite).
    """
    if dtype.kind == "f" and dtype.itemsize < 8:
        try:
            with np.errstate(over="raise"):
                return _numbers(data, dtype)
        except FloatingPointError:
            raise OverflowError(_range(dtype)) from None
    return _numbers(data, dtype)


def _numbers(data: Any, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    allowed, what = _JSON_TYPES[dtype.kind]
    if (isinstance(data, list) and data and not isinstance(data[0], list)
            and (len(data) <= _SCAN_MAX or dtype.kind != "f")):
        if not allowed.issuperset(map(type, data)):
            raise TypeError(f"elements must be JSON {what}")
        try:
            return np.asarray(data, dtype=dtype)
        except OverflowError:
            raise OverflowError(_range(dtype)) from None
    found = np.asarray(data)
    if found.size == 0:
        return found.astype(dtype)
    if found.dtype.kind not in _KINDS[dtype.kind]:
        elements: list[Any] = np.asarray(data, dtype=np.object_).ravel().tolist()
        if dtype.kind in "iu" and all(type(v) is int for v in elements):
            raise OverflowError(_range(dtype))  # integers numpy could only read as floats
        raise TypeError(f"elements must be JSON {what}")
    if found.dtype.kind in "iu" and dtype.kind in "iu":
        info = np.iinfo(dtype)
        if found.min() < info.min or found.max() > info.max:
            raise OverflowError(_range(dtype))
    if dtype.kind != "b":
        zero_or_one = (found == 0) | (found == 1)
        if zero_or_one.any() and bool in map(type, np.asarray(data, dtype=np.object_)[
                zero_or_one]):
            raise TypeError(f"elements must be JSON {what}")
    return found.astype(dtype, copy=False)


def _range(dtype: np.dtype[Any]) -> str:
    """What an element of ``dtype`` may be, for an overflow's message."""
    if dtype.kind == "f":
        largest = float(np.finfo(dtype).max)
        return f"elements must lie in {-largest!r}..{largest!r}"
    info = np.iinfo(dtype)
    return f"elements must lie in {info.min}..{info.max}"


def _wanted_outputs(raw: Any) -> tuple[list[str], dict[str, bool], dict[str, ShmRef]]:
    """Names of the requested outputs, their ``binary_data`` flags where given, and the
    regions of those asked for in shared memory."""
    if raw is None:
        return [], {}, {}
    if not isinstance(raw, list):
        raise InvalidInput("'outputs' must be a list")
    names: list[str] = []
    flags: dict[str, bool] = {}
    regions: dict[str, ShmRef] = {}
    for i, item in enumerate(raw):
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str):
            raise InvalidInput(f"outputs[{i}]: 'name' must be a string")
        params = item.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(f"output {name!r}: 'parameters' must be an object")
        reject_unsupported(f"output {name!r}", params)
        if isinstance(params.get("binary_data"), bool):
            flags[name] = params["binary_data"]
        ref = tensor_ref(name, params)
        if ref is not None:
            if params.get("binary_data") is True:
                raise InvalidInput("Output can't set both 'shared_memory_region' and "
                                   "'binary_data'")
            regions[name] = ref
        names.append(name)
    return names, flags, regions


UNSUPPORTED = {"classification": "classification outputs"}
"""Tensor parameters of Triton extensions conveyor does not implement."""


def reject_unsupported(where: str, params: Collection[str]) -> None:
    """Refuse a Triton extension we lack, rather than answer something the client does not expect."""
    for key, what in UNSUPPORTED.items():
        if key in params:
            raise InvalidInput(f"{where}: {what} ({key!r}) are not supported by conveyor")


def check_outputs(names: list[str], config: ModelConfig) -> list[str]:
    """Reject an output asked for twice, and outputs the model does not declare (any name
    if it declares none)."""
    if len(set(names)) != len(names):
        twice = next(n for i, n in enumerate(names) if n in names[:i])
        raise InvalidInput(f"output '{twice}' already exists in request")
    known = {o.name for o in config.outputs}
    for name in names:
        if known and name not in known:
            raise InvalidInput(f"unexpected inference output '{name}' for model '{config.name}'")
    return names


def chosen_outputs(outputs: list[Tensor], wanted: list[str]) -> list[Tensor]:
    return [t for t in outputs if t.name in wanted] if wanted else outputs


def render(model: str, request: InferRequest, outputs: list[Tensor]) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary tensors follow it."""
    blobs: list[bytes | memoryview] = []
    described: list[dict[str, Any]] = []
    for tensor in chosen_outputs(outputs, request.outputs):
        if tensor.name in request.shm_outputs:  # its data went into the region
            described.append({"name": tensor.name, "datatype": tensor.datatype,
                              "shape": list(tensor.shape)})
        elif request.binary(tensor.name):
            described.append({"name": tensor.name, "datatype": tensor.datatype,
                              "shape": list(tensor.shape),
                              "parameters": {"binary_data_size": len(tensor.raw)}})
            blobs.append(tensor.raw)
        else:
            described.append(_json_output(tensor))
    body: dict[str, Any] = {"model_name": model, "model_version": request.version,
                            "outputs": described}
    if request.id is not None:
        body["id"] = request.id
    header = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def _json_output(tensor: Tensor) -> dict[str, Any]:
    array = tensor.array().reshape(-1)
    data: Any
    if tensor.datatype == "BYTES":
        try:
            data = [bytes(v).decode() for v in array]
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"output '{tensor.name}' holds BYTES that are not valid UTF-8 ({exc.reason} at "
                f"byte {exc.start} of an element), which JSON cannot carry: request it with "
                '"parameters": {"binary_data": true}') from None
    elif tensor.datatype == "FP16":
        data = array.astype(np.float32)
    else:
        data = array
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
            "data": data}
