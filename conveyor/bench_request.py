"""The request ``conveyor bench`` sends over and over: tensors from the model's metadata
(random) or from a file, and their body as KServe v2 JSON, binary tensors or a framed gRPC
``ModelInferRequest``.

The load generators send one fixed body, so it is built once here. The gRPC message is
encoded by hand (a few length-delimited fields): the command line may not import ``api/``
(docs/architecture.md), and tritonclient's generated classes come only with the test
extra.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from batching.datatypes import DATATYPES, from_numpy, to_numpy, to_raw

BYTES_LENGTH = 16
"""Characters of each random BYTES element."""
INT_END = 100
"""Random integers lie in 0 .. INT_END - 1: valid for every integer type, and small enough
for a model that takes them as indices."""
PROTOCOLS = ("json", "binary", "grpc")
_PREFIX = struct.Struct(">BI")  # gRPC message framing: compressed flag, big-endian length


class BenchError(Exception):
    """Why ``conveyor bench`` cannot measure: said to the user, exit status 1."""


@dataclass(frozen=True)
class Input:
    """One input tensor of the request."""

    name: str
    datatype: str
    array: npt.NDArray[Any]


@dataclass(frozen=True)
class Body:
    """A request body and the headers it needs beyond the method and length."""

    content: bytes
    headers: dict[str, str]


def request_shape(shape: list[int], rows: int) -> tuple[int, ...]:
    """A declared shape made concrete: a dynamic (-1) first dim is the batch of ``rows``,
    any other dynamic dim is 1."""
    return tuple(rows if dim == -1 and index == 0 else 1 if dim == -1 else dim
                 for index, dim in enumerate(shape))


def random_array(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> npt.NDArray[Any]:
    """Random data of ``datatype``: floats in [0, 1), integers below ``INT_END``, bools,
    and lowercase ASCII strings for BYTES."""
    if datatype not in DATATYPES:
        raise BenchError(f"datatype {datatype!r} is not a KServe v2 datatype")
    if datatype == "BYTES":
        count = int(np.prod(shape))
        letters = rng.integers(ord("a"), ord("z") + 1, size=(count, BYTES_LENGTH), dtype=np.uint8)
        return np.array([row.tobytes() for row in letters], dtype=np.object_).reshape(shape)
    dtype = to_numpy(datatype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.kind in "iu":
        return rng.integers(0, INT_END, size=shape).astype(dtype)
    return rng.random(size=shape).astype(dtype)


def random_inputs(metadata: dict[str, Any], rows: int, seed: int = 0) -> list[Input]:
    """Random tensors for every input the model's metadata declares."""
    rng = np.random.default_rng(seed)
    declared = metadata.get("inputs") or []
    if not declared:
        raise BenchError(f"model {metadata.get('name')!r} declares no inputs: give them with --input")
    return [Input(item["name"], item["datatype"],
                  random_array(item["datatype"], request_shape(item["shape"], rows), rng))
            for item in declared]


def file_inputs(path: Path, metadata: dict[str, Any]) -> list[Input]:
    """The tensors of ``path``: a .npy array is the model's one input, a .npz holds one
    array per input name, a .json file is a KServe v2 request body."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            return json_inputs(json.loads(path.read_text()), path)
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return [_array_input(name, archive[name]) for name in archive.files]
        if suffix == ".npy":
            declared = metadata.get("inputs") or []
            if len(declared) != 1:
                raise BenchError(f"{path}: model {metadata.get('name')!r} has {len(declared)} "
                                 "inputs; name each in an .npz")
            return [_array_input(declared[0]["name"], np.load(path, allow_pickle=False))]
    except (OSError, ValueError) as exc:
        raise BenchError(f"{path}: {exc}") from None
    raise BenchError(f"{path}: expected a .npy, .npz or KServe v2 .json file")


def json_inputs(doc: Any, path: Path) -> list[Input]:
    """The inputs of a KServe v2 JSON request body, as arrays of their datatypes."""
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise BenchError(f"{path} is not a KServe v2 request body (no 'inputs' list)")
    inputs = []
    for item in doc["inputs"]:
        try:
            name, datatype, shape, data = item["name"], item["datatype"], item["shape"], item["data"]
        except (KeyError, TypeError):
            raise BenchError(f"{path}: each input needs name, datatype, shape and data") from None
        if datatype == "BYTES":
            flat = [v.encode() if isinstance(v, str) else v for v in np.asarray(data).reshape(-1)]
            array = np.array(flat, dtype=np.object_).reshape(shape)
        elif datatype in DATATYPES:
            array = np.asarray(data, dtype=to_numpy(datatype)).reshape(shape)
        else:
            raise BenchError(f"{path}: input {name!r} has datatype {datatype!r}, not a KServe v2 one")
        inputs.append(Input(name, datatype, array))
    return inputs


def _array_input(name: str, array: npt.NDArray[Any]) -> Input:
    if array.dtype.kind in "SU":
        array = array.astype(np.object_)
    return Input(name, from_numpy(array.dtype), array)


def body(protocol: str, model: str, inputs: list[Input]) -> Body:
    """The request body of ``protocol``, outputs asked for as that protocol's clients do."""
    if protocol == "json":
        return json_body(inputs)
    if protocol == "binary":
        return binary_body(inputs)
    if protocol == "grpc":
        return grpc_body(model, inputs)
    raise BenchError(f"protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")


def json_body(inputs: list[Input]) -> Body:
    """A KServe v2 JSON body; BYTES elements are text, as JSON carries them."""
    try:
        doc = {"inputs": [{"name": item.name, "datatype": item.datatype, "shape": list(item.array.shape),
                           "data": _json_data(item)} for item in inputs]}
    except UnicodeDecodeError:
        raise BenchError("BYTES data that is not UTF-8 text cannot travel as JSON: "
                         "use --protocol binary or grpc") from None
    return Body(json.dumps(doc).encode(), {"Content-Type": "application/json"})


def _json_data(item: Input) -> list[Any]:
    flat = item.array.reshape(-1)
    if item.datatype == "BYTES":
        return [v.decode() if isinstance(v, bytes) else str(v) for v in flat]
    values: list[Any] = flat.tolist()
    return values


def binary_body(inputs: list[Input]) -> Body:
    """The binary tensor extension: a JSON header, then each input's raw bytes, with
    binary outputs asked for (tritonclient's default)."""
    raws = [to_raw(item.array) for item in inputs]
    header = json.dumps({
        "inputs": [{"name": item.name, "datatype": item.datatype, "shape": list(item.array.shape),
                    "parameters": {"binary_data_size": len(raw)}}
                   for item, raw in zip(inputs, raws, strict=True)],
        "parameters": {"binary_data_output": True},
    }).encode()
    return Body(header + b"".join(raws), {"Content-Type": "application/octet-stream",
                                          "Inference-Header-Content-Length": str(len(header))})


def grpc_body(model: str, inputs: list[Input]) -> Body:
    """A ``ModelInferRequest`` with its inputs in ``raw_input_contents`` (as tritonclient
    sends them), framed as one gRPC message."""
    message = _field(1, model.encode())
    for item in inputs:
        shape = b"".join(_varint(dim) for dim in item.array.shape)
        message += _field(5, _field(1, item.name.encode()) + _field(2, item.datatype.encode())
                          + _field(3, shape))
    for item in inputs:
        message += _field(7, to_raw(item.array))
    return Body(_PREFIX.pack(0, len(message)) + message,
                {"Content-Type": "application/grpc", "TE": "trailers"})


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (strings, bytes, messages, packed numbers)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)
