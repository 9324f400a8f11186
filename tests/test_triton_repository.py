"""Triton's repository format read in-process: config.pbtxt into conveyor's configuration,
what is refused and why, version folders and policies, max_batch_size 0, the JSON config
of a repository load, and a TritonPythonModel behind conveyor's predict."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batching.config import ConfigError, InstanceGroup, ModelConfig, TensorSpec, VersionPolicy
from batching.envelope import VERSION, WHOLE, Request, Tensor
from batching.errors import InvalidInput, ModelFailure
from batching.former import BatchFormer, Entry
from batching.policy import FixedWindow
from batching.repository_scan import load_model_config, scan_repository, status_table
from batching.signature import check_inputs
from batching.triton_config import triton_config
from batching.triton_repository import json_config, pbtxt_config
from tests.triton_layout import REVERSE_MODEL, REVERSE_PBTXT, SCALE_PBTXT, Scale, export_onnx
from workers.backends import load_model


def from_pbtxt(text: str, name: str = "m") -> ModelConfig:
    return ModelConfig.from_dict(name, pbtxt_config(name, text.encode()), "onnx")


def pbtxt_refused(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        from_pbtxt(text)
    return str(caught.value)


def test_config_pbtxt_becomes_conveyors_configuration() -> None:
    config = from_pbtxt(SCALE_PBTXT, "scale")
    assert (config.backend, config.max_batch_size) == ("onnx", 8)
    assert config.inputs == (TensorSpec("INPUT0", "FP32", (-1, 4)),)
    assert config.batching.max_queue_delay_us == 500
    assert config.batching.preferred_batch_sizes == (4, 8)
    assert (config.queue.priority_levels, config.queue.default_priority) == (2, 2)
    assert config.queue.max_queue_rows == 100
    assert config.instances == (InstanceGroup("cpu", 1),)
    assert config.version_policy == VersionPolicy("latest", 2)


@pytest.mark.parametrize("batching", ["", "dynamic_batching { }",
                                      "dynamic_batching { preferred_batch_size: [ 4 ] }"])
def test_a_triton_configuration_waits_only_when_it_says_so(batching: str) -> None:
    """No max_queue_delay_microseconds (or no dynamic_batching) is 0 in Triton, not
    conveyor's adaptive bound; the load's config reads the same way."""
    text = f"max_batch_size: 8\n{batching}"
    assert from_pbtxt(text).batching.max_queue_delay_us == 0
    document = json.dumps({"max_batch_size": 8, **({"dynamic_batching": {}} if batching else {})})
    assert ModelConfig.from_dict("m", json_config("m", document), "onnx") \
        .batching.max_queue_delay_us == 0


def test_the_rest_of_the_fields_conveyor_understands() -> None:
    config = from_pbtxt("""
        backend: "onnxruntime"  # comments are fine
        max_batch_size: 4
        default_model_filename: "graph.onnx"
        input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] format: FORMAT_NONE
                  reshape { shape: [ -1 ] } } ]
        dynamic_batching {
          default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 2500
                                 allow_timeout_override: true }
          priority_queue_policy { key: 1 value { default_timeout_microseconds: 2500 } }
        }
        instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] }, { kind: KIND_CPU } ]
        version_policy { specific { versions: [ 1, 3 ] } }
        parameters { key: "conveyor.latency_target_ms" value { string_value: "20" } }
        parameters { key: "conveyor.execution_timeout_s" value { string_value: "5" } }
        parameters [ { key: "mode" value: { string_value: "fast" } } ]
        model_transaction_policy { decoupled: false }
    """)
    assert config.artifact == "graph.onnx"
    assert config.inputs == (TensorSpec("TEXT", "BYTES", (-1, -1)),)
    assert config.queue.default_timeout_ms == 3
    assert config.instances == (InstanceGroup("cuda:0", 2), InstanceGroup("cuda:1", 2),
                                InstanceGroup("cpu", 1))
    assert config.version_policy == VersionPolicy("specific", specific=(1, 3))
    assert config.batching.latency_target_ms == 20 and config.execution_timeout_s == 5
    assert config.parameters == {"mode": "fast"}


def test_reshape_gives_the_model_its_own_shape(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text(
        "import numpy as np\n"
        "class Model:\n"
        "    def __init__(self, config, device):\n"
        "        pass\n"
        "    def predict(self, inputs):\n"
        "        assert inputs['x'].shape == (2,), inputs['x'].shape\n"
        "        return {'y': np.repeat(inputs['x'], 4).reshape(2, 2, 2)}\n")
    config = ModelConfig.from_dict("m", pbtxt_config("m", b"""
        max_batch_size: 4
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ ] } } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] reshape { shape: [ 2, 2 ] } } ]
    """), "python")
    assert config.inputs == (TensorSpec("x", "FP32", (-1, 1), reshape=()),)
    assert triton_config(config)["output"][0]["reshape"] == {"shape": [2, 2]}
    model = load_model(config, tmp_path, "cpu")
    outputs = model.predict({"x": np.array([[1], [2]], np.float32)})
    np.testing.assert_array_equal(outputs["y"], [[1] * 4, [2] * 4])


def test_max_batch_size_0_keeps_dims_as_they_are() -> None:
    config = from_pbtxt('input [ { name: "x" data_type: TYPE_INT32 dims: [ 2, 3 ] } ]')
    assert config.max_batch_size == 0 and not config.batched and config.batch_rows == 1
    assert config.inputs == (TensorSpec("x", "INT32", (2, 3)),)
    assert triton_config(config)["input"][0]["dims"] == [2, 3]
    assert check_inputs(config, [("x", "INT32", (2, 3))]) == 1
    with pytest.raises(InvalidInput, match=r"Expected \[2,3\], got \[1,2,3\]"):
        check_inputs(config, [("x", "INT32", (1, 2, 3))])


@pytest.mark.parametrize("text,expected", [
    ("sequence_batching { }", "line 1: sequence batching (stateful models) is not supported"),
    ("ensemble_scheduling { step [ ] }", 'ensemble_scheduling needs platform: "ensemble"'),
    ('platform: "ensemble"', "an ensemble is no model of its own"),
    ("model_transaction_policy { decoupled: true }", "decoupled models"),
    ('platform: "tensorrt_plan"', "platform 'tensorrt_plan' is not supported"),
    ('backend: "tensorflow"', "backend 'tensorflow' is not supported"),
    ('platform: "onnxruntime_onnx" backend: "pytorch"', "disagree"),
    ("\n\nmodel_warmup [ { name: \"w\" } ]", "line 3: model_warmup is not supported by conveyor"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] reshape { shape: [ 3 ] } } ]',
     "inputs[0].reshape [3] does not hold the 4 elements of [4]"),
    ('max_batch_size: 2 output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] '
     'reshape { shape: [ 2 ] } } ]', "outputs[0].reshape needs fixed dims (no -1, no pad)"),
    ('input [ { name: "x" data_type: TYPE_BF16 dims: [ 4 ] } ]', "data_type 'TYPE_BF16'"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] optional: true } ]',
     "optional: true is not supported"),
    ("dynamic_batching { preserve_ordering: true }", "preserve_ordering"),
    ("dynamic_batching { default_queue_policy { timeout_action: DELAY } }",
     "timeout_action 'DELAY' is not supported"),
    ("dynamic_batching { priority_levels: 2 default_priority_level: 1 "
     "priority_queue_policy { key: 1 value { max_queue_size: 3 } } }",
     "a priority level's own queue policy is not supported"),
    ("instance_group [ { kind: KIND_MODEL } ]", "kind 'KIND_MODEL' is not supported"),
    ("version_policy { }", "give exactly one of latest, all, specific"),
    ('name: "other"', "name 'other' is not the model folder's name 'm'"),
    ('max_batch_size: "8"', "max_batch_size must be an integer, got '8'"),
    ("max_batch_size: 8 max_batch_size: 4", "max_batch_size is given more than once"),
    ("max_batch_size: -1", "max_batch_size must be >= 0"),
    ('input [ { name: "x" ', "line 1: expected a field name or '}'"),
    ('name: "a\\q"', "unsupported escape"),
    ("max_batch_size 8", "expected ':' after 'max_batch_size'"),
    ("dims: @", "unexpected character '@'"),
])
def test_what_conveyor_does_not_serve_is_refused_by_name(text: str, expected: str) -> None:
    message = pbtxt_refused(text)
    assert message.startswith("m: ") and expected in message, message


def test_a_torch_export_models_config_round_trips() -> None:
    raw = {"backend": "torch_export", "inputs": [{"name": "x", "datatype": "FP32",
                                                 "shape": [-1, 2]}],
           "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]}
    config = ModelConfig.from_dict("m", raw)
    again = ModelConfig.from_dict("m", json_config("m", json.dumps(triton_config(config))))
    assert (again.backend, again.inputs) == ("torch_export", config.inputs)


def test_the_start_up_table_has_a_line_per_served_version() -> None:
    table = status_table([("scale", "LOADED"), ("echo", "LOADED")], {"scale": ("2", "3")})
    assert "| scale | 2       | LOADED |" in table and "| scale | 3       | LOADED |" in table
    assert "| echo  | 1       | LOADED |" in table


def test_a_load_config_in_triton_json_round_trips_through_config_endpoint() -> None:
    config = from_pbtxt(SCALE_PBTXT, "scale")
    document = json.loads(json.dumps(triton_config(config)))
    document["dynamic_batching"]["max_queue_delay_microseconds"] = "900"  # int64 as JSON text
    again = ModelConfig.from_dict("scale", json_config("scale", json.dumps(document)))
    assert again.batching.max_queue_delay_us == 900
    assert again.version_policy == config.version_policy
    assert (again.inputs, again.outputs, again.queue) == (config.inputs, config.outputs,
                                                        config.queue)
    for bad, expected in (("[]", "must be a JSON object"), ("{", "is not JSON"),
                          ('{"sequence_batching": {}}', "sequence batching")):
        with pytest.raises(ConfigError, match=expected):
            json_config("scale", bad)


def scale_folder(root: Path, versions: tuple[int, ...], pbtxt: str = SCALE_PBTXT) -> Path:
    folder = root / "scale"
    for version in versions:
        export_onnx(Scale(float(version)), folder / str(version) / "model.onnx")
    (folder / "config.pbtxt").write_text(pbtxt)
    return folder


def test_the_version_policy_chooses_the_folders_served(tmp_path: Path) -> None:
    folder = scale_folder(tmp_path, (1, 2, 10))
    assert load_model_config(folder).versions == ("2", "10"), "numeric order, not text"
    (folder / "notes").mkdir()  # not a version folder
    override = {**pbtxt_config("scale", SCALE_PBTXT.encode()), "version_policy": {"all": True}}
    assert load_model_config(folder, override).versions == ("1", "2", "10")
    override["version_policy"] = {"specific": [7]}
    with pytest.raises(ConfigError, match="no version folder matches the version policy"):
        load_model_config(folder, override)
    (folder / "10" / "model.onnx").unlink()
    with pytest.raises(ConfigError, match=r"version 10 has no model\.onnx"):
        load_model_config(folder)


def test_a_value_the_schema_refuses_says_it_came_from_config_pbtxt(tmp_path: Path) -> None:
    scale_folder(tmp_path, (1,), SCALE_PBTXT.replace("priority_levels: 2", "priority_levels: 99"))
    scan = scan_repository(tmp_path)
    assert scan.failed["scale"].startswith(
        "scale: config.pbtxt, read as config.yaml keys: queue.priority_levels must be <= 64")


def test_config_yaml_and_config_pbtxt_together_are_refused(tmp_path: Path) -> None:
    folder = scale_folder(tmp_path, (1,))
    (folder / "config.yaml").write_text("max_batch_size: 4\n")
    scan = scan_repository(tmp_path)
    assert "both config.yaml and config.pbtxt" in scan.failed["scale"]


def test_an_onnx_graph_with_a_fixed_first_dim_is_not_batched(tmp_path: Path) -> None:
    export_onnx(Scale(1.0), tmp_path / "fixed" / "model.onnx", dynamic_batch=False)
    config = load_model_config(tmp_path / "fixed")
    assert config.max_batch_size == 0
    assert config.inputs == (TensorSpec("INPUT0", "FP32", (1, 4)),)
    (tmp_path / "fixed" / "config.yaml").write_text("max_batch_size: 16\n")
    with pytest.raises(ConfigError, match="INPUT0 FP32 \\[1, 4\\] has no variable batch dim"):
        load_model_config(tmp_path / "fixed")


def test_a_torchscript_model_in_a_version_folder_serves_from_config_pbtxt(
        tmp_path: Path) -> None:
    import torch

    folder = tmp_path / "ts"
    (folder / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        torch.jit.script(Scale(2.0)).save(str(folder / "1" / "model.pt"))  # type: ignore[no-untyped-call]
    (folder / "config.pbtxt").write_text("""
        platform: "pytorch_libtorch"
        max_batch_size: 4
        input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
    """)
    config = load_model_config(folder)
    assert (config.backend, config.versions) == ("torchscript", ("1",))
    model = load_model(config, folder / "1", "cpu")
    outputs = model.predict({"INPUT__0": np.ones((2, 4), np.float32)})
    np.testing.assert_array_equal(outputs["OUTPUT__0"], np.full((2, 4), 2.0))


def test_a_torchscript_model_must_declare_its_signature(tmp_path: Path) -> None:
    (tmp_path / "ts").mkdir()
    (tmp_path / "ts" / "model.pt").write_bytes(b"not read")
    with pytest.raises(ConfigError, match="torchscript model needs its inputs and outputs"):
        load_model_config(tmp_path / "ts")


def test_config_yaml_takes_versions_and_no_batch_dim_too(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    for version in (1, 2):
        (folder / str(version)).mkdir(parents=True)
        (folder / str(version) / "model.py").write_text("")
    (folder / "config.yaml").write_text(
        "max_batch_size: 0\nversion_policy: {all: true}\n"
        "inputs: [{name: x, datatype: FP32, shape: [3], pad: {axis: 0}}]\n")
    with pytest.raises(ConfigError, match=r"inputs\[0\].pad needs a batch dim"):
        load_model_config(folder)
    (folder / "config.yaml").write_text(
        "max_batch_size: 0\nversion_policy: {all: false}\n")
    with pytest.raises(ConfigError, match=r"version_policy\.all must be true"):
        load_model_config(folder)
    (folder / "config.yaml").write_text("max_batch_size: 0\nversion_policy: {latest: 1}\n")
    assert load_model_config(folder).versions == ("2",)


def entry(version: str, rows: int = 1, **params: Any) -> Entry:
    inputs = [Tensor.from_array("x", np.zeros((rows, 4), np.float32))]
    request = Request("id", "reply", 10**13, 0, 1, inputs, params={VERSION: version, **params})
    return Entry("s", "1-0", request, 0.0)


def test_a_batch_holds_one_version_and_a_whole_request_runs_alone() -> None:
    former = BatchFormer(FixedWindow(8, 0.0), 8)
    former.add([entry("2"), entry("3"), entry("2")])
    assert [e.request.params[VERSION] for e in former.take("full").entries] == ["2", "2"]
    assert [e.request.params[VERSION] for e in former.take("full").entries] == ["3"]
    alone = BatchFormer(FixedWindow(1, 0.0), 1)
    alone.add([entry("1", rows=3, **{WHOLE: 1}), entry("1", rows=3, **{WHOLE: 1})])
    assert alone.pending_rows == 2, "a request without a batch dim counts one row"
    assert len(alone.take("full").entries) == 1


def test_a_triton_python_model_serves_behind_predict(tmp_path: Path) -> None:
    folder = tmp_path / "reverse"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(REVERSE_PBTXT)
    (folder / "1" / "model.py").write_text(REVERSE_MODEL)
    config = load_model_config(folder)
    model = load_model(config, folder / "1", "cpu")
    outputs = model.predict({"INPUT0": np.array([1, 2, 3], np.float32)})
    np.testing.assert_array_equal(outputs["OUTPUT0"], [3.5, 2.5, 1.5])
    np.testing.assert_array_equal(outputs["SIZE"], [3])

    (folder / "1" / "model.py").write_text(
        "import triton_python_backend_utils as pb_utils\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        return [pb_utils.InferenceResponse(error=pb_utils.TritonError('bad input'))"
        " for _ in requests]\n")
    failing = load_model(config, folder / "1", "cpu")
    with pytest.raises(ModelFailure, match="reverse: bad input"):
        failing.predict({"INPUT0": np.array([1, 2, 3], np.float32)})
