"""KServe v2 JSON bodies <-> tensors. No pydantic here: this is the infer hot path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from batching.config import ModelConfig
from batching.datatypes import to_numpy
from batching.envelope import Tensor
from batching.errors import InvalidInput
from batching.signature import check_inputs


@dataclass(slots=True)
class InferRequest:
    id: str | None
    inputs: list[Tensor]
    rows: int
    outputs: list[str] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)


def parse_json(body: bytes, config: ModelConfig) -> InferRequest:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("request body must be a JSON object")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("'inputs' must be a non-empty list of tensors")
    heads = [_head(i, item) for i, item in enumerate(raw_inputs)]
    rows = check_inputs(config, heads)
    tensors = [_tensor(name, datatype, shape, item["data"])
               for (name, datatype, shape), item in zip(heads, raw_inputs, strict=True)]
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be an object")
    rid = doc.get("id")
    return InferRequest(
        id=str(rid) if rid is not None else None,
        inputs=tensors,
        rows=rows,
        outputs=_wanted_outputs(doc.get("outputs"), config),
        parameters=params,
    )


def _head(index: int, item: Any) -> tuple[str, str, tuple[int, ...]]:
    if not isinstance(item, dict):
        raise InvalidInput(f"inputs[{index}] must be an object")
    name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
    if not isinstance(name, str):
        raise InvalidInput(f"inputs[{index}]: 'name' must be a string")
    if not isinstance(datatype, str):
        raise InvalidInput(f"input {name!r}: 'datatype' must be a string")
    to_numpy(datatype)
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InvalidInput(f"input {name!r}: 'shape' must be a list of non-negative integers")
    if "data" not in item:
        raise InvalidInput(f"input {name!r}: 'data' is missing")
    return name, datatype, tuple(shape)


def _tensor(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> Tensor:
    count = int(np.prod(shape, dtype=np.int64))
    try:
        if datatype == "BYTES":
            flat = np.asarray(data, dtype=np.object_).reshape(-1)
            array = np.array([v.encode() if isinstance(v, str) else v for v in flat],
                             dtype=np.object_)
        else:
            array = np.asarray(data, dtype=to_numpy(datatype))
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(f"input {name!r}: data is not {datatype}: {exc}") from None
    if array.size != count:
        raise InvalidInput(
            f"input {name!r}: {array.size} elements of data do not fill shape {list(shape)} "
            f"({count} expected)"
        )
    return Tensor.from_array(name, array.reshape(shape), datatype)


def _wanted_outputs(raw: Any, config: ModelConfig) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidInput("'outputs' must be a list")
    names = []
    known = {o.name for o in config.outputs}
    for i, item in enumerate(raw):
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str):
            raise InvalidInput(f"outputs[{i}]: 'name' must be a string")
        if known and name not in known:
            raise InvalidInput(f"unknown output {name!r}; model {config.name!r} has {sorted(known)}")
        names.append(name)
    return names


def render_json(model: str, request_id: str | None, outputs: list[Tensor],
                wanted: list[str]) -> bytes:
    chosen = [t for t in outputs if t.name in wanted] if wanted else outputs
    body: dict[str, Any] = {"model_name": model, "model_version": "1",
                            "outputs": [_json_output(t) for t in chosen]}
    if request_id is not None:
        body["id"] = request_id
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _json_output(tensor: Tensor) -> dict[str, Any]:
    array = tensor.array().reshape(-1)
    data: Any
    if tensor.datatype == "BYTES":
        data = [bytes(v).decode("utf-8", "replace") for v in array]
    elif tensor.datatype == "FP16":
        data = array.astype(np.float32)
    else:
        data = array
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
            "data": data}
