"""gRPC ModelInferRequest -> :class:`InferRequest`, and reply tensors -> ModelInferResponse.

Inputs come as ``raw_input_contents`` (one entry per input, in input order: what
``tritonclient`` sends) or in the typed ``contents`` fields; either way they are checked
against the model's signature exactly as HTTP requests are. Outputs always go back in
``raw_output_contents``, the only place ``tritonclient`` reads them from.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from api.binary import tensor_from_buffer
from api.kserve import InferRequest, check_outputs, chosen_outputs, reject_unsupported
from api.proto import inference_pb2 as pb
from batching.config import ModelConfig
from batching.datatypes import to_numpy
from batching.envelope import Tensor
from batching.errors import InvalidInput
from batching.signature import check_inputs

_CONTENTS = {
    "BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
    "UINT32": "uint_contents", "UINT64": "uint64_contents", "INT8": "int_contents",
    "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
"""The typed ``InferTensorContents`` field of each datatype (FP16 has none: raw only)."""


def parameters(params: Any) -> dict[str, Any]:
    """An ``InferParameter`` map as plain values (priority: uint64, timeout: int64 µs...)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(value, which)
    return out


def parse_request(request: pb.ModelInferRequest, config: ModelConfig) -> InferRequest:
    heads = [(t.name, t.datatype, tuple(t.shape)) for t in request.inputs]
    rows = check_inputs(config, heads)
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for "
                           f"{len(request.inputs)} inputs; give one per input, in input order")
    for output in request.outputs:
        reject_unsupported(f"output {output.name!r}", output.parameters)
    tensors = []
    for i, (tensor, (name, datatype, shape)) in enumerate(zip(request.inputs, heads, strict=True)):
        reject_unsupported(f"input {name!r}", tensor.parameters)
        to_numpy(datatype)
        if raw:
            tensors.append(tensor_from_buffer(name, datatype, shape, raw[i]))
        else:
            tensors.append(_from_contents(name, datatype, shape, tensor.contents))
    return InferRequest(
        id=request.id or None,
        inputs=tensors,
        rows=rows,
        outputs=check_outputs([o.name for o in request.outputs], config),
        parameters=parameters(request.parameters),
    )


def _from_contents(name: str, datatype: str, shape: tuple[int, ...], contents: Any) -> Tensor:
    field = _CONTENTS.get(datatype)
    if field is None:
        raise InvalidInput(f"input {name!r}: {datatype} data must come in raw_input_contents")
    values = getattr(contents, field)
    try:
        if datatype == "BYTES":
            array = np.array(list(values), dtype=np.object_)
        else:
            array = np.asarray(values, dtype=to_numpy(datatype))
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(f"input {name!r}: contents are not {datatype}: {exc}") from None
    count = math.prod(shape)
    if array.size != count:
        raise InvalidInput(f"input {name!r}: {array.size} elements in contents.{field} do not "
                           f"fill shape {list(shape)} ({count} expected)")
    return Tensor.from_array(name, array.reshape(shape), datatype)


def infer_response(model: str, request: InferRequest,
                   outputs: list[Tensor]) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model, model_version=request.version,
                                      id=request.id or "")
    for tensor in chosen_outputs(outputs, request.outputs):
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(tensor.raw)
    return response
