"""A rejected gRPC ModelInfer frees its request at once, without a garbage collection.

The servicer runs on a real grpc.aio server, in a process of its own
(tests/grpc_rejects_probe.py), with no Redis: the requests are rejected before they
would be queued. With the collector off, a request kept in a reference cycle would be
freed only by the next collection; ``gc.DEBUG_SAVEALL`` shows what that collection frees.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, cast

import pytest

from tests.procs import ROOT


def probe(model: str, mode: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "tests.grpc_rejects_probe", model, mode],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return cast(dict[str, Any], json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("model,error", [
    ("nope", "NOT_FOUND: Request for unknown model: 'nope' is not found"),
    ("m", "INVALID_ARGUMENT: input byte size mismatch for input 'a' for model 'm'. Expected 8, "
          "got 4194304"),
])
def test_rejected_model_infer_requests_are_freed_without_a_collection(model: str,
                                                                      error: str) -> None:
    result = probe(model, "unary")
    assert len(result["errors"]) == result["count"], result
    assert all(e.startswith(error) for e in result["errors"]), result
    assert result["held"] == 0


def test_rejected_stream_requests_are_freed_without_a_collection() -> None:
    result = probe("nope", "stream")
    assert result["errors"] == ["Request for unknown model: 'nope' is not found"] * result["count"]
    assert result["held"] == 0
