"""cpu_threads: validated strictly, derived from the cores when unset, and handed to
onnxruntime's session options and torch's thread pools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from batching.config import ConfigError, CpuThreads, ModelConfig
from batching.settings import Settings
from tests.conftest import MakeStack
from tests.procs import Proc, wait_for
from workers import every_core
from workers.backends import load_model
from workers.cpu_threads import Threads, cpu_threads, lone_threads, with_cpu_threads
from workers.every_core import EveryCore, load_served

ROOT = Path(__file__).resolve().parents[1]


def _config(backend: str = "onnx", **raw: Any) -> ModelConfig:
    return ModelConfig.from_dict("m", raw, backend)


def _refused(backend: str, **raw: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        _config(backend, **raw)
    return str(caught.value)


def test_without_the_key_nothing_is_configured() -> None:
    assert _config().cpu_threads == CpuThreads(intra_op=None, inter_op=1, spin=False)


def test_the_key_reaches_the_model_config() -> None:
    config = _config(cpu_threads={"intra_op": 3, "inter_op": 2, "spin": True})
    assert config.cpu_threads == CpuThreads(intra_op=3, inter_op=2, spin=True)


def test_parameters_threads_still_sets_the_intra_op_threads() -> None:
    assert _config("torchscript", parameters={"threads": 2}).cpu_threads.intra_op == 2
    assert _config("python", parameters={"threads": "free-form"}).cpu_threads.intra_op is None


@pytest.mark.parametrize("backend,raw,expected", [
    ("onnx", {"cpu_threads": {"intra_op": 0}}, "cpu_threads.intra_op must be >= 1, got 0"),
    ("onnx", {"cpu_threads": {"inter_op": 0}}, "cpu_threads.inter_op must be >= 1, got 0"),
    ("onnx", {"cpu_threads": {"intra_op": "4"}},
     "cpu_threads.intra_op must be an integer, got '4' (a quoted string"),
    ("onnx", {"cpu_threads": {"inter_op": True}}, "cpu_threads.inter_op must be an integer"),
    ("onnx", {"cpu_threads": {"intra_op": 2.0}}, "cpu_threads.intra_op must be an integer"),
    ("onnx", {"cpu_threads": {"spin": "yes"}}, "cpu_threads.spin must be true or false"),
    ("onnx", {"cpu_threads": {"intra": 2}},
     "unknown key 'intra' in cpu_threads (did you mean 'intra_op'?)"),
    ("onnx", {"cpu_threads": 4}, "cpu_threads must be a mapping"),
    ("torchscript", {"cpu_threads": {"spin": True}},
     "cpu_threads.spin: true applies to the onnx backend only"),
    ("python", {"cpu_threads": {"intra_op": 2}},
     "cpu_threads applies to the onnx, torch_export, torchscript backends, not python"),
    ("onnx", {"cpu_threads": {"intra_op": 2}, "parameters": {"threads": 2}},
     "parameters.threads and cpu_threads.intra_op both set the intra-op threads"),
])
def test_a_bad_cpu_threads_is_refused(backend: str, raw: dict[str, Any], expected: str) -> None:
    assert expected in _refused(backend, **raw)


def test_spin_off_is_accepted_for_torch() -> None:
    assert not _config("torch_export", cpu_threads={"spin": False}).cpu_threads.spin


@pytest.mark.parametrize("instances,cores,intra_op", [
    ([{"device": "cpu", "count": 1}], 8, 8),            # one instance alone: every core
    ([{"device": "cpu", "count": 2}, {"device": "cuda", "count": 1}], 8, 4),
    ([{"device": "cpu", "count": 3}], 8, 2),
    ([{"device": "cpu", "count": 4}], 2, 1),            # never fewer than one
    ([{"device": "cuda:0", "count": 2}], 6, 6),         # no CPU instance shares the cores
])
def test_unset_intra_op_divides_the_cores_among_the_cpu_instances(
        instances: list[dict[str, Any]], cores: int, intra_op: int) -> None:
    assert cpu_threads(_config(instances=instances), cores) == Threads(intra_op, 1, False)


@pytest.mark.parametrize("instances,cores,reserved,intra_op", [
    ([{"device": "cpu", "count": 1}], 2, 1, 1),         # two cores: one for the API and Redis
    ([{"device": "cpu", "count": 1}], 8, 1, 7),
    ([{"device": "cpu", "count": 2}], 8, 2, 3),
    ([{"device": "cpu", "count": 1}], 2, 4, 1),         # never fewer than one
    ([{"device": "cuda", "count": 1}], 6, 1, 5),
])
def test_reserved_cores_are_left_out_of_the_derived_threads(
        instances: list[dict[str, Any]], cores: int, reserved: int, intra_op: int) -> None:
    assert cpu_threads(_config(instances=instances), cores, reserved).intra_op == intra_op


def test_configured_threads_ignore_the_reserve() -> None:
    config = _config(cpu_threads={"intra_op": 2})
    assert cpu_threads(config, 2, 1).intra_op == 2
    assert with_cpu_threads(config, 1) is config


def test_the_worker_fixes_unset_threads_with_its_reserve() -> None:
    cores = len(os.sched_getaffinity(0))
    config = with_cpu_threads(_config(cpu_threads={"inter_op": 2, "spin": True}), 1)
    assert config.cpu_threads == CpuThreads(intra_op=max(1, cores - 1), inter_op=2, spin=True)
    python = _config("python")
    assert with_cpu_threads(python, 1) is python  # no thread pools to size


def test_one_core_is_reserved_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_RESERVED_CORES", raising=False)
    assert Settings().reserved_cores == 1
    monkeypatch.setenv("CONVEYOR_RESERVED_CORES", "0")
    assert Settings().reserved_cores == 0


def test_an_inference_worker_leaves_its_reserve_to_the_host(
        tmp_path: Path, make_stack: MakeStack) -> None:
    """Real workers serving an ONNX model with no config: by default one core is left to the
    processes beside the model, none with ``CONVEYOR_RESERVED_CORES=0``."""
    (tmp_path / "m").mkdir()
    _onnx_identity(tmp_path / "m" / "model.onnx")
    cores = len(os.sched_getaffinity(0))
    default, alone = make_stack(tmp_path), make_stack(tmp_path, CONVEYOR_RESERVED_CORES="0")
    workers = [(default.add_worker(), max(1, cores - 1)), (alone.add_worker(), cores)]
    for worker, threads in workers:
        line = f"m: onnxruntime runs {threads} intra-op"
        wait_for(partial(_logged, worker, line), 60, f"{line!r} in {worker.name}'s log")


def _logged(worker: Proc, line: str) -> bool:
    return line in worker.log()


@pytest.mark.parametrize("raw,device,cores,reserved,lone", [
    ({}, "cpu", 2, 1, 2),                                   # the reserved core, for lone batches
    ({}, "cpu", 8, 2, 8),
    ({"instances": [{"device": "cpu", "count": 2}]}, "cpu", 8, 2, 4),
    ({}, "cpu", 2, 0, None),                                # nothing reserved
    ({}, "cpu", 1, 1, None),                                # one core: one thread either way
    ({"instances": [{"device": "cpu", "count": 4}]}, "cpu", 4, 1, None),
    ({"cpu_threads": {"intra_op": 1}}, "cpu", 8, 1, None),  # set in config.yaml
    ({}, "cuda:0", 8, 1, None),
])
def test_lone_batches_get_the_threads_of_no_reserve(
        raw: dict[str, Any], device: str, cores: int, reserved: int, lone: int | None) -> None:
    config = lone_threads(_config(**raw), reserved, device, cores)
    assert (None if config is None else config.cpu_threads.intra_op) == lone


def test_a_python_model_has_no_lone_threads() -> None:
    assert lone_threads(_config("python"), 1, "cpu", 8) is None


def test_lone_batches_on_every_core_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_LONE_ALL_CORES", raising=False)
    assert Settings().lone_all_cores
    monkeypatch.setenv("CONVEYOR_LONE_ALL_CORES", "false")
    assert not Settings().lone_all_cores


def test_an_onnx_model_runs_lone_batches_in_a_session_on_every_core(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sessions = _sessions(tmp_path, monkeypatch)
    reserved = _config(cpu_threads={"intra_op": 2})
    lone = lone_threads(_config(), 1, "cpu", 3)
    model = load_served(reserved, tmp_path, "cpu", lone)
    assert isinstance(model, EveryCore)
    assert [s.get_session_options().intra_op_num_threads for s in sessions] == [2, 3]
    x = np.ones((2, 3), dtype=np.float32)
    np.testing.assert_array_equal(model.predict({"X": x})["Y"], x)
    np.testing.assert_array_equal(model.predict_lone({"X": x}, 2)["Y"], x)  # the first: every core
    assert not isinstance(load_served(reserved, tmp_path, "cpu", None), EveryCore)
    monkeypatch.setattr(every_core, "LONE_SESSION_MAX_BYTES",  # a model just over the limit
                        (tmp_path / "model.onnx").stat().st_size - 1)
    assert not isinstance(load_served(reserved, tmp_path, "cpu", lone), EveryCore)


TORCH_LONE_CHILD = """
    import json, sys
    from pathlib import Path
    import numpy as np
    import torch
    from batching.config import ModelConfig
    from workers import cpu_threads, every_core

    class Threads:  # the loaded model: reports the intra-op threads it ran with
        def predict(self, inputs):
            return {"threads": np.full((1, 1), torch.get_num_threads())}

    every_core.load_model = lambda config, folder, device: Threads()
    config = ModelConfig.from_dict("m", {}, "torchscript")
    torch.set_num_threads(1)
    reserved = ModelConfig.from_dict("m", {"cpu_threads": {"intra_op": 1}}, "torchscript")
    model = every_core.load_served(reserved, Path("."), "cpu",
                                   cpu_threads.lone_threads(config, 2, "cpu", 3))
    x = {"INPUT0": np.zeros((1, 1), np.float32)}
    seen = [model.predict_lone(x, 1)["threads"].item(), torch.get_num_threads(),
            model.predict(x)["threads"].item()]
    print(json.dumps(seen))
"""


def test_a_torch_model_runs_lone_batches_on_every_core_and_gives_them_back() -> None:
    """Three cores, two of them reserved: a lone batch runs on three threads, and the pool
    is back to one after it."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(TORCH_LONE_CHILD)], cwd=ROOT,
                         check=True, capture_output=True, text=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [3, 1, 1]


def test_configured_threads_ignore_the_cores() -> None:
    config = _config(cpu_threads={"intra_op": 5, "inter_op": 2, "spin": True},
                     instances=[{"count": 4}])
    assert cpu_threads(config, 2) == Threads(5, 2, True)


def test_the_cores_are_the_process_affinity() -> None:
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(_config()).intra_op == cores


def _onnx_identity(path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["Y"])], "identity",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))


def _sessions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[ort.InferenceSession]:
    """An identity model in ``tmp_path``, and the list of every onnxruntime session made
    from now on."""
    _onnx_identity(tmp_path / "model.onnx")
    sessions: list[ort.InferenceSession] = []
    real = ort.InferenceSession

    def capture(*args: Any, **kwargs: Any) -> ort.InferenceSession:
        sessions.append(real(*args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(ort, "InferenceSession", capture)
    return sessions


def _onnx_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  config: ModelConfig) -> ort.SessionOptions:
    """The options of the session ``load_model`` builds (and that session still predicts)."""
    sessions = _sessions(tmp_path, monkeypatch)
    model = load_model(config, tmp_path, "cpu")
    x = np.ones((2, 3), dtype=np.float32)
    np.testing.assert_array_equal(model.predict({"X": x})["Y"], x)
    return sessions[0].get_session_options()


def test_onnx_session_gets_the_configured_threads(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(cpu_threads={"intra_op": 3, "inter_op": 2, "spin": True})
    options = _onnx_options(tmp_path, monkeypatch, config)
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (3, 2)
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert options.get_session_config_entry("session.inter_op.allow_spinning") == "1"


def test_onnx_session_by_default_uses_the_cores_without_spinning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = _onnx_options(tmp_path, monkeypatch, _config(instances=[{"count": 2}]))
    assert options.intra_op_num_threads == max(1, len(os.sched_getaffinity(0)) // 2)
    assert options.inter_op_num_threads == 1
    assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert options.get_session_config_entry("session.inter_op.allow_spinning") == "0"


TORCH_CHILD = """
    import json, os, sys, warnings
    from pathlib import Path
    import torch
    from batching.config import ModelConfig
    from workers.backends import load_model

    folder = Path(sys.argv[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(torch.nn.Identity()).save(str(folder / "model.pt"))
    config = ModelConfig.from_dict("m", json.loads(sys.argv[2]), "torchscript")
    load_model(config, folder, "cpu")
    print(json.dumps([torch.get_num_threads(), torch.get_num_interop_threads(),
                      len(os.sched_getaffinity(0))]))
"""


def _torch_pools(tmp_path: Path, raw: dict[str, Any]) -> tuple[int, int, int]:
    """(intra-op, inter-op, cores) of a fresh process, as an inference process has, once
    it loaded a TorchScript model with ``raw`` as its config."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(TORCH_CHILD), str(tmp_path),
                          json.dumps(raw)], cwd=ROOT, check=True, capture_output=True, text=True)
    intra, inter, cores = json.loads(out.stdout.strip().splitlines()[-1])
    return intra, inter, cores


def test_torch_pools_get_the_configured_threads(tmp_path: Path) -> None:
    intra, inter, _ = _torch_pools(tmp_path, {"cpu_threads": {"intra_op": 1, "inter_op": 3}})
    assert (intra, inter) == (1, 3)


def test_torch_pools_by_default_use_the_cores_and_one_inter_op_thread(tmp_path: Path) -> None:
    intra, inter, cores = _torch_pools(tmp_path, {})
    assert (intra, inter) == (cores, 1)
