"""Checking a request's tensors against a model's declared signature, before Redis."""

from __future__ import annotations

from collections.abc import Sequence

from batching.config import ModelConfig, TensorSpec
from batching.errors import InvalidInput


def check_inputs(config: ModelConfig, given: Sequence[tuple[str, str, tuple[int, ...]]]) -> int:
    """Validate (name, datatype, shape) triples; return the request's row count.

    Every message names the input and says what was expected. A model without a
    declared signature accepts any inputs that agree on their batch dim.
    """
    names = [name for name, _, _ in given]
    if not given:
        raise InvalidInput("request has no inputs")
    if len(set(names)) != len(names):
        raise InvalidInput(f"duplicate input names in {names}")
    if config.inputs:
        expected = {spec.name for spec in config.inputs}
        unknown = [n for n in names if n not in expected]
        if unknown:
            raise InvalidInput(
                f"unknown input {unknown[0]!r} for model {config.name!r}; "
                f"expected {sorted(expected)}"
            )
        missing = [s.name for s in config.inputs if s.name not in names]
        if missing:
            spec = config.input(missing[0])
            assert spec is not None
            raise InvalidInput(f"missing input {spec.describe()} for model {config.name!r}")
    rows: int | None = None
    for name, datatype, shape in given:
        spec = config.input(name)
        if spec is not None:
            _check_one(spec, datatype, shape)
        if not config.batched:
            continue
        if not shape:
            raise InvalidInput(f"input {name!r}: shape must have the batch dim first, got []")
        if rows is None:
            rows = shape[0]
        elif shape[0] != rows:
            raise InvalidInput(
                f"input {name!r} has {shape[0]} rows but {names[0]!r} has {rows}; "
                "every input needs the same batch dim"
            )
    if not config.batched:
        return 1  # no batch dim: the request is one unit of work, whatever its shapes
    assert rows is not None
    if rows < 1:
        raise InvalidInput(f"input {names[0]!r}: the batch dim must be at least 1, got {rows}")
    if rows > config.max_batch_size:
        raise InvalidInput(
            f"input {names[0]!r} has {rows} rows; model {config.name!r} takes at most "
            f"{config.max_batch_size} per request (max_batch_size)"
        )
    return rows


def _check_one(spec: TensorSpec, datatype: str, shape: tuple[int, ...]) -> None:
    if datatype != spec.datatype:
        raise InvalidInput(f"input {spec.name!r}: datatype {datatype}, expected {spec.datatype}")
    if len(shape) != len(spec.shape):
        raise InvalidInput(
            f"input {spec.name!r}: shape {list(shape)} has rank {len(shape)}, "
            f"expected rank {len(spec.shape)} {list(spec.shape)}"
        )
    for axis, (got, want) in enumerate(zip(shape, spec.shape, strict=True)):
        if want != -1 and got != want:
            raise InvalidInput(
                f"input {spec.name!r}: dim {axis} is {got}, expected {want} "
                f"(shape {list(spec.shape)}, -1 = any)"
            )
