"""What a failing model tells its clients: one line, no server paths (the worker logs all).

A TorchScript model without a config.yaml that fails on its inputs raises a message that
quotes the TorchScript interpreter's code and the model's original source, with its
path on the server.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from batching.config import ModelConfig
from batching.errors import ModelFailure
from batching.former import Layout
from workers.backends import SUMMARY_MAX, error_summary, load_model
from workers.batch_run import BatchRunner


class MatMul(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


def failing_torchscript(folder: Path) -> ModelFailure:
    """Run a scripted model without config on shapes it cannot multiply, as the worker does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        torch.jit.script(MatMul()).save(str(folder / "model.pt"))  # type: ignore[no-untyped-call]
    config = ModelConfig.from_dict("mm", {}, "torchscript")
    model = load_model(config, folder, "cpu")
    runner = BatchRunner(config.name, Layout.of(config), model, {}, {})
    inputs = {"a": np.ones((2, 3), np.float32), "b": np.ones((2, 3), np.float32)}
    with pytest.raises(ModelFailure) as caught:
        runner.predict(inputs, 2, model)
    return caught.value


def test_a_torchscript_failure_reaches_clients_as_one_line_without_paths(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="conveyor.inference"):
        error = failing_torchscript(tmp_path)
    assert error.message == ("model 'mm' failed: RuntimeError: mat1 and mat2 shapes cannot "
                             "be multiplied (2x3 and 2x3)")
    assert __file__ in caplog.text  # the worker's log keeps the whole text, paths included


@pytest.mark.parametrize("exc,summary", [
    (ValueError("cannot open /srv/models/x/weights.bin: no such file\nmore"),
     "ValueError: cannot open weights.bin: no such file"),
    (OSError("C:\\models\\a.bin is missing; 1/2 of a/b"), "OSError: a.bin is missing; 1/2 of a/b"),
    (KeyError(), "KeyError"),
    (RuntimeError("RuntimeError: already named"), "RuntimeError: already named"),
])
def test_error_summaries(exc: BaseException, summary: str) -> None:
    assert error_summary(exc) == summary


def test_long_messages_are_cut() -> None:
    summary = error_summary(ValueError("x" * 1000))
    assert len(summary) == SUMMARY_MAX and summary.endswith("...")
