"""Checking a request's tensors against a model's declared signature, before Redis.

The messages are worded as Triton words them (its clients and tests match the text);
shapes print as Triton prints them, ``[-1,16]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from batching.config import ModelConfig, TensorSpec
from batching.errors import InvalidInput

INT64_MAX = 2**63 - 1
"""The largest dimension a shape may have (shapes are int64 on every protocol)."""


def dims(shape: Iterable[int]) -> str:
    """A shape as Triton's messages show it: ``[1,16]``."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def name_list(names: Iterable[str]) -> str:
    """Names as Triton's messages list them: ``['INPUT0','INPUT1']``."""
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def check_dims(name: str, shape: Sequence[int]) -> None:
    """Every dimension of input ``name`` lies in 0..INT64_MAX."""
    if any(d < 0 or d > INT64_MAX for d in shape):
        raise InvalidInput(f"input '{name}': shape {dims(shape)} has a dimension outside "
                           f"0..{INT64_MAX}")


def check_inputs(config: ModelConfig, given: Sequence[tuple[str, str, tuple[int, ...]]]) -> int:
    """Validate (name, datatype, shape) triples; return the request's row count.

    Every message names the input and says what was expected. A model without a
    declared signature accepts any inputs that agree on their batch dim. Every dimension
    lies in 0..INT64_MAX (a gRPC shape may hold a negative one).
    """
    for name, _, shape in given:
        check_dims(name, shape)
    names = [name for name, _, _ in given]
    model = config.name
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidInput(f"input '{name}' already exists in request")
        seen.add(name)
    if config.inputs:
        expected = [spec.name for spec in config.inputs]
        if len(names) != len(expected):
            missing = [n for n in expected if n not in seen]
            raise InvalidInput(
                f"expected {len(expected)} inputs but got {len(names)} inputs for model "
                f"'{model}'. Got input(s) {name_list(names)}, but missing required input(s) "
                f"{name_list(missing)}. Please provide all required input(s).")
        unknown = [n for n in names if n not in expected]
        if unknown:
            raise InvalidInput(f"unexpected inference input '{unknown[0]}' for model '{model}'")
    elif not given:
        raise InvalidInput("request has no inputs")
    rows = _batch_rows(config, given) if config.batched else 1
    for name, datatype, shape in given:
        spec = config.input(name)
        if spec is not None:
            _check_one(model, spec, datatype, shape)
    return rows  # no batch dim: the request is one unit of work, whatever its shapes


def _batch_rows(config: ModelConfig, given: Sequence[tuple[str, str, tuple[int, ...]]]) -> int:
    """The batch dim every input shares, checked against ``max_batch_size``."""
    model = config.name
    rows: int | None = None
    for name, _, shape in given:
        if not shape:
            raise InvalidInput(f"input '{name}' has no shape but model requires batch "
                               f"dimension for '{model}'")
        if rows is None:
            rows = shape[0]
        elif shape[0] != rows:
            raise InvalidInput(f"input '{name}' batch size does not match other inputs "
                               f"for '{model}'")
    assert rows is not None
    if rows < 1:
        raise InvalidInput(f"input {given[0][0]!r}: the batch dim must be at least 1, got {rows}")
    if rows > config.max_batch_size:
        raise InvalidInput(f"inference request batch-size must be <= {config.max_batch_size} "
                           f"for '{model}'")
    return rows


def _check_one(model: str, spec: TensorSpec, datatype: str, shape: tuple[int, ...]) -> None:
    if datatype != spec.datatype:
        raise InvalidInput(f"inference input '{spec.name}' data-type is '{datatype}', but "
                           f"model '{model}' expects '{spec.datatype}'")
    if len(shape) != len(spec.shape) or any(
            want != -1 and got != want for got, want in zip(shape, spec.shape, strict=True)):
        raise InvalidInput(f"unexpected shape for input '{spec.name}' for model '{model}'. "
                           f"Expected {dims(spec.shape)}, got {dims(shape)}")
