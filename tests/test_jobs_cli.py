"""``conveyor jobs``: a result is saved in the form its file name says, and ``watch`` waits.

The API is an ``httpx.MockTransport``, so these run in-process in milliseconds; the CLI
against a real stack is in tests/test_jobs.py and tests/test_docs_examples.py.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from batching.datatypes import from_numpy, to_raw
from conveyor import jobs_cli

JOB = "5eb808f23e324057a8bca71219c52570"
PROBABILITIES = np.arange(20, dtype=np.float32).reshape(2, 10)
LABELS = np.array([7, 3], dtype=np.int64)


def _status(state: str) -> dict[str, Any]:
    return {"id": JOB, "model": "digits", "state": state, "progress": {"done": 2, "total": 2}}


def _binary(outputs: dict[str, np.ndarray]) -> httpx.Response:
    raws = [to_raw(array) for array in outputs.values()]
    header = json.dumps({"id": JOB, "model_name": "digits", "model_version": "1", "outputs": [
        {"name": name, "datatype": from_numpy(array.dtype), "shape": list(array.shape),
         "parameters": {"binary_data_size": len(raw)}}
        for (name, array), raw in zip(outputs.items(), raws, strict=True)]}).encode()
    return httpx.Response(200, content=header + b"".join(raws),
                          headers={"inference-header-content-length": str(len(header))})


class Api:
    """A job API answering one job whose result holds ``outputs``; records every request."""

    def __init__(self, outputs: dict[str, np.ndarray], states: tuple[str, ...] = ("SUCCEEDED",)):
        self.outputs = outputs
        self.states = list(states)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == f"/v1/jobs/{JOB}":
            state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
            return httpx.Response(200, json=_status(state))
        if path == f"/v1/jobs/{JOB}/result":
            if request.url.params.get("binary_data_output") == "true":
                return _binary(self.outputs)
            return httpx.Response(200, json={"id": JOB, "model_name": "digits", "outputs": [
                {"name": name, "datatype": from_numpy(array.dtype), "shape": list(array.shape),
                 "data": array.ravel().tolist()} for name, array in self.outputs.items()]})
        if path == "/v1/jobs" and request.method == "POST":
            return httpx.Response(202, json={"id": JOB, "status_url": f"/v1/jobs/{JOB}"})
        return httpx.Response(404, json={"error": f"no route {path}"})


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Callable[[Api], Api]:
    """Route the CLI's HTTP client to an ``Api``."""
    def use(api: Api) -> Api:
        monkeypatch.setattr(httpx, "Client",
                            functools.partial(httpx.Client, transport=httpx.MockTransport(api)))
        return api
    monkeypatch.setattr("conveyor.jobs_cli.POLL_S", 0.0)
    return use


def _jobs(*args: str) -> int:
    """``conveyor jobs ARGS`` as the console script parses it (without conveyor.cli, which
    names the launcher, so this module stays in-process)."""
    parser = argparse.ArgumentParser(prog="conveyor")
    jobs_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return jobs_cli.run(parser.parse_args(["jobs", *args, "--url", "http://conveyor.test"]))


def test_result_to_npy_saves_the_one_output_as_an_array(serve: Callable[[Api], Api],
                                                         tmp_path: Path) -> None:
    serve(Api({"probabilities": PROBABILITIES}))
    assert _jobs("result", JOB, "-o", str(tmp_path / "res.npy")) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "res.npy", allow_pickle=False), PROBABILITIES)


def test_result_to_npz_saves_every_output_by_name(serve: Callable[[Api], Api],
                                                   tmp_path: Path) -> None:
    serve(Api({"probabilities": PROBABILITIES, "labels": LABELS}))
    assert _jobs("result", JOB, "-o", str(tmp_path / "res.npz")) == 0
    with np.load(tmp_path / "res.npz", allow_pickle=False) as saved:
        assert sorted(saved.files) == ["labels", "probabilities"]
        np.testing.assert_array_equal(saved["probabilities"], PROBABILITIES)
        np.testing.assert_array_equal(saved["labels"], LABELS)


def test_result_to_json_saves_the_kserve_body(serve: Callable[[Api], Api], tmp_path: Path) -> None:
    api = serve(Api({"probabilities": PROBABILITIES}))
    assert _jobs("result", JOB, "-o", str(tmp_path / "res.json")) == 0
    body = json.loads((tmp_path / "res.json").read_text())
    assert body["outputs"][0]["data"] == PROBABILITIES.ravel().tolist()
    assert "binary_data_output" not in api.requests[-1].url.params


def test_result_to_npy_with_several_outputs_names_them_and_writes_nothing(
        serve: Callable[[Api], Api], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serve(Api({"probabilities": PROBABILITIES, "labels": LABELS}))
    assert _jobs("result", JOB, "-o", str(tmp_path / "res.npy")) == 1
    assert "2 outputs (probabilities, labels)" in capsys.readouterr().err
    assert not (tmp_path / "res.npy").exists()


@pytest.mark.parametrize("action", [("result", JOB), ("watch", JOB), ("submit", "x.npy", "-m", "d")])
def test_an_unknown_suffix_fails_before_any_request(
        serve: Callable[[Api], Api], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        action: tuple[str, ...]) -> None:
    api = serve(Api({"probabilities": PROBABILITIES}))
    assert _jobs(*action, "-o", str(tmp_path / "res.txt")) == 1
    assert "name a .npy" in capsys.readouterr().err
    assert api.requests == [] and not (tmp_path / "res.txt").exists()


def test_watch_waits_for_the_end_and_saves_the_result(
        serve: Callable[[Api], Api], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serve(Api({"probabilities": PROBABILITIES}, states=("PENDING", "RUNNING", "SUCCEEDED")))
    assert _jobs("watch", JOB, "-o", str(tmp_path / "res.npy")) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["state"] == "SUCCEEDED" and "2/2 rows 100% SUCCEEDED" in err
    np.testing.assert_array_equal(np.load(tmp_path / "res.npy"), PROBABILITIES)


def test_watch_exits_1_for_a_job_that_did_not_succeed(serve: Callable[[Api], Api],
                                                      tmp_path: Path) -> None:
    serve(Api({"probabilities": PROBABILITIES}, states=("RUNNING", "FAILED")))
    assert _jobs("watch", JOB, "-o", str(tmp_path / "res.npy")) == 1
    assert not (tmp_path / "res.npy").exists()
