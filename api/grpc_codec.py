"""gRPC ModelInferRequest -> :class:`InferRequest`, and reply tensors -> ModelInferResponse.

Inputs come as ``raw_input_contents`` (one entry per input, in input order: what
``tritonclient`` sends) or in the typed ``contents`` fields; either way they are checked
against the model's signature exactly as HTTP requests are. An input given by shared
memory region has no ``raw_input_contents`` entry. Outputs always go back in
``raw_output_contents``, the only place ``tritonclient`` reads them from; one written into
a shared memory region has an empty entry there.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from api.binary import tensor_from_buffer
from api.kserve import InferRequest, check_outputs, chosen_outputs, reject_unsupported
from api.proto import inference_pb2 as pb
from api.shm_params import ShmRef, tensor_ref
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
    refs = {i: ref for i, t in enumerate(request.inputs)
            if (ref := tensor_ref(t.name, parameters(t.parameters))) is not None}
    _check_contents(request, refs, config.name)
    raw = iter(request.raw_input_contents)
    expected = len(request.inputs) - len(refs)
    if request.raw_input_contents and len(request.raw_input_contents) != expected:
        raise InvalidInput(f"raw_input_contents has {len(request.raw_input_contents)} entries "
                           f"for {expected} inputs not in shared memory; give one per input, "
                           "in input order")
    shm_outputs = {}
    for output in request.outputs:
        reject_unsupported(f"output {output.name!r}", output.parameters)
        ref = tensor_ref(output.name, parameters(output.parameters))
        if ref is not None:
            shm_outputs[output.name] = ref
    tensors = []
    for i, (tensor, (name, datatype, shape)) in enumerate(zip(request.inputs, heads, strict=True)):
        reject_unsupported(f"input {name!r}", tensor.parameters)
        to_numpy(datatype)
        if i in refs:
            tensors.append(Tensor(name, datatype, shape, b""))
        elif request.raw_input_contents:
            tensors.append(tensor_from_buffer(name, datatype, shape, next(raw), config.name))
        else:
            tensors.append(_from_contents(name, datatype, shape, tensor.contents, config.name))
    return InferRequest(
        id=request.id or None,
        inputs=tensors,
        rows=rows,
        outputs=check_outputs([o.name for o in request.outputs], config),
        parameters=parameters(request.parameters),
        shm_inputs=refs,
        shm_outputs=shm_outputs,
    )


def _check_contents(request: pb.ModelInferRequest, refs: dict[int, ShmRef], model: str) -> None:
    """Refuse typed ``contents`` on an input read from a region or given in
    ``raw_input_contents`` (Triton's words, input by input, before the raw entries count)."""
    for i, tensor in enumerate(request.inputs):
        if not tensor.HasField("contents"):
            continue
        if i in refs:
            raise InvalidInput(f"unexpected 'content' provided when using shared memory for "
                               f"input tensor '{tensor.name}' for model '{model}'")
        if request.raw_input_contents:
            raise InvalidInput(f"contents field must not be specified when using "
                               f"raw_input_contents for '{tensor.name}' for model '{model}'")


def _from_contents(name: str, datatype: str, shape: tuple[int, ...], contents: Any,
                   model: str) -> Tensor:
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
    if array.size != count:  # the same words as for raw bytes, as Triton checks them as bytes
        where = f"inference input '{name}' for model '{model}'"
        if datatype == "BYTES":
            raise InvalidInput(f"expected {count} string elements for {where}, got {array.size}")
        raise InvalidInput(f"input byte size mismatch for input '{name}' for model '{model}'. "
                           f"Expected {count * array.itemsize}, got {array.size * array.itemsize}")
    return Tensor.from_array(name, array.reshape(shape), datatype)


def infer_response(model: str, request: InferRequest,
                   outputs: list[Tensor]) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model, model_version=request.version,
                                      id=request.id or "")
    for tensor in chosen_outputs(outputs, request.outputs):
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        # an output written into shared memory keeps its place, empty (as Triton does)
        response.raw_output_contents.append(b"" if tensor.name in request.shm_outputs
                                            else tensor.raw)
    return response
