"""config.yaml validated by type: strict values, key paths, near-miss keys, YAML errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from batching.config import (
    BatchingConfig,
    ConfigError,
    InstanceGroup,
    ModelConfig,
    QueueConfig,
    TensorSpec,
)
from batching.repository_scan import load_model_config

ROOT = Path(__file__).resolve().parent.parent
X = {"name": "x", "datatype": "FP32", "shape": [-1, 4]}


def tensor(**changes: Any) -> dict[str, Any]:
    return {**X, **changes}


def refused(raw: dict[str, Any], backend: str | None = "python") -> str:
    with pytest.raises(ConfigError) as caught:
        ModelConfig.from_dict("folder", raw, backend)
    message = str(caught.value)
    assert message.startswith("folder: ")
    return message


@pytest.mark.parametrize("raw,expected", [
    # quoted numbers (issue 10, item 9) are refused, never coerced
    ({"queue": {"priority_levels": "3"}},
     "queue.priority_levels must be an integer, got '3' (a quoted string"),
    ({"instances": [{"count": "2"}]}, "instances[0].count must be an integer, got '2'"),
    ({"batching": {"latency_target_ms": "50"}},
     "batching.latency_target_ms must be a number, got '50' (a quoted string"),
    ({"max_batch_size": "8"}, "max_batch_size must be an integer, got '8'"),
    ({"execution_timeout_s": "3"}, "execution_timeout_s must be a number, got '3'"),
    ({"max_batch_cost": "10"}, "max_batch_cost must be a number, got '10'"),
    ({"batching": {"max_queue_delay_us": "100"}}, "batching.max_queue_delay_us must be an integer"),
    ({"batching": {"preferred_batch_sizes": [4, "8"]}},
     "batching.preferred_batch_sizes[1] must be an integer, got '8'"),
    ({"inputs": [tensor(shape=[-1, "4"])]}, "inputs[0].shape[1] must be an integer, got '4'"),
    ({"inputs": [tensor(shape=[-1, 3], pad={"axis": "1"})]},
     "inputs[0].pad.axis must be an integer, got '1'"),
    # booleans are not integers; floats are not integers
    ({"max_batch_size": True}, "max_batch_size must be an integer, got True (a boolean)"),
    ({"instances": [{"count": True}]}, "instances[0].count must be an integer, got True"),
    ({"max_deliveries": 2.0}, "max_deliveries must be an integer, got 2.0"),
    ({"batching": {"latency_target_ms": True}}, "batching.latency_target_ms must be a number"),
    ({"batching": {"adaptive": "yes"}}, "batching.adaptive must be true or false, got 'yes'"),
    ({"batching": {"adaptive": 1}}, "batching.adaptive must be true or false, got 1"),
    # bounds: values that would crash or wedge a process later
    ({"max_batch_size": -1}, "max_batch_size must be >= 0, got -1"),
    ({"max_batch_size": 2**40}, "max_batch_size must be <= 2147483647"),
    ({"queue": {"priority_levels": 0, "default_priority": 1}},
     "queue.priority_levels must be >= 1, got 0"),
    ({"queue": {"priority_levels": 100000}}, "queue.priority_levels must be <= 64"),
    ({"queue": {"default_priority": 0}}, "queue.default_priority must be >= 1, got 0"),
    ({"queue": {"priority_levels": 2, "default_priority": 3}},
     "queue.default_priority must be within 1..priority_levels (2), got 3"),
    ({"queue": {"priority_levels": 1}}, "queue.default_priority must be within 1..priority_levels"),
    ({"queue": {"max_queue_rows": 0}}, "queue.max_queue_rows must be >= 1"),
    ({"queue": {"default_timeout_ms": 0}}, "queue.default_timeout_ms must be >= 1"),
    ({"queue": {"default_timeout_ms": -5}}, "queue.default_timeout_ms must be >= 1, got -5"),
    ({"batching": {"max_queue_delay_us": -1}}, "batching.max_queue_delay_us must be >= 0"),
    ({"batching": {"latency_target_ms": 0}}, "batching.latency_target_ms must be > 0, got 0"),
    ({"batching": {"latency_target_ms": float("nan")}},
     "batching.latency_target_ms must be a finite number"),
    ({"batching": {"preferred_batch_sizes": [0]}},
     "batching.preferred_batch_sizes[0] must be >= 1"),
    ({"execution_timeout_s": 0}, "execution_timeout_s must be > 0"),
    ({"execution_timeout_s": -1.5}, "execution_timeout_s must be > 0, got -1.5"),
    ({"execution_timeout_s": None}, "execution_timeout_s must be a number, got None"),
    ({"max_batch_cost": 0}, "max_batch_cost must be > 0, got 0"),
    ({"max_batch_cost": True}, "max_batch_cost must be a number, got True"),
    ({"max_deliveries": 0}, "max_deliveries must be >= 1, got 0"),
    ({"instances": [{"count": 0}]}, "instances[0].count must be >= 1, got 0"),
    ({"instances": [{}, {"count": -2}]}, "instances[1].count must be >= 1, got -2"),
    ({"instances": [{"device": "gpu"}]},
     "instances[0].device must be cpu, cuda or cuda:<index>, got 'gpu'"),
    ({"instances": [{"device": "cuda:x"}]}, "instances[0].device must be cpu, cuda or cuda:<index>"),
    ({"instances": [{"device": 0}]}, "instances[0].device must be a string, got 0"),
    ({"instances": {"device": "cpu"}}, "instances must be a list"),
    ({"instances": ["cpu"]}, "instances[0] must be a mapping, got 'cpu'"),
    ({"parameters": [1, 2]}, "parameters must be a mapping, got [1, 2]"),
    ({"parameters": {1: "a"}}, "parameters has a key 1 that is not a string"),
    ({"platform": 3}, "platform must be a string, got 3"),
    ({"queue": 3}, "queue must be a mapping, got 3"),
    ({"batching": ["adaptive"]}, "batching must be a mapping"),
    # tensors: names, datatypes, shapes and pads
    ({"inputs": {"x": X}}, "inputs must be a list"),
    ({"inputs": ["x"]}, "inputs[0] must be a mapping, got 'x'"),
    ({"inputs": [{"datatype": "FP32", "shape": [-1]}]}, "inputs[0].name is required"),
    ({"outputs": [{"name": "y", "shape": [-1]}]}, "outputs[0].datatype is required"),
    ({"inputs": [{"name": "x", "datatype": "FP32"}]}, "inputs[0].shape is required"),
    ({"inputs": [tensor(name=7)]}, "inputs[0].name must be a string, got 7"),
    ({"inputs": [tensor(name="")]}, "inputs[0].name must not be empty"),
    ({"inputs": [X, tensor(datatype="INT64")]}, "inputs[1].name 'x' is also inputs[0]'s"),
    ({"outputs": [tensor(datatype="FP33")]}, "outputs[0].datatype must be one of BOOL, "),
    ({"outputs": [tensor(datatype="FP33")]}, "got 'FP33'"),
    ({"inputs": [tensor(shape=[])]}, "inputs[0].shape must not be empty"),
    ({"inputs": [tensor(shape=[-1, 0])]},
     "inputs[0].shape[1] must be -1 (any size) or a positive integer, got 0"),
    ({"inputs": [tensor(shape=[-1, -2])]}, "inputs[0].shape[1] must be -1 (any size)"),
    ({"inputs": [tensor(shape=[-1, 2**70])]}, "inputs[0].shape[1] must be <= 9223372036854775807"),
    ({"inputs": [tensor(shape=[-1, True])]}, "inputs[0].shape[1] must be an integer, got True"),
    ({"inputs": [tensor(shape="-1, 4")]}, "inputs[0].shape must be a list"),
    ({"inputs": [tensor(shape=[-1, -1], pad={"axis": 0})]},
     "inputs[0].pad.axis must name a variable (-1) axis after the batch dim"),
    ({"inputs": [tensor(shape=[-1, 4], pad={"axis": 1})]},
     "inputs[0].pad.axis must name a variable (-1) axis after the batch dim of shape [-1, 4], got 1"),
    ({"inputs": [tensor(shape=[-1, -1], pad={"axis": 2})]}, "inputs[0].pad.axis must name"),
    ({"inputs": [tensor(shape=[-1, -1], pad={})]}, "inputs[0].pad.axis is required"),
    ({"inputs": [tensor(shape=[-1, -1], pad=1)]}, "inputs[0].pad must be a mapping, got 1"),
    ({"outputs": [tensor(shape=[-1, -1], pad={"axis": 1, "value": "0"})]},
     "outputs[0].pad.value must be a number, got '0'"),
    ({"inputs": [tensor(datatype="UINT8", shape=[-1, -1], pad={"axis": 1, "value": 300})]},
     "inputs[0].pad.value 300 does not fit UINT8"),
    ({"inputs": [tensor(datatype="INT64", shape=[-1, -1], pad={"axis": 1, "value": 0.5})]},
     "inputs[0].pad.value 0.5 does not fit INT64"),
    ({"inputs": [tensor(datatype="BOOL", shape=[-1, -1], pad={"axis": 1, "value": 2})]},
     "inputs[0].pad.value 2 does not fit BOOL"),
    # unknown keys, with the nearest known key
    ({"max_batch": 3}, "unknown key 'max_batch' (did you mean 'max_batch_size'?)"),
    ({"batching": {"max_batch": 3}},
     "unknown key 'max_batch' in batching (known keys: adaptive, latency_target_ms, "),
    ({"batching": {"max_queue_delay": 3}},
     "unknown key 'max_queue_delay' in batching (did you mean 'max_queue_delay_us'?)"),
    ({"queue": {"priority_level": 3}},
     "unknown key 'priority_level' in queue (did you mean 'priority_levels'?)"),
    ({"instances": [{}, {"devices": "cpu"}]},
     "unknown key 'devices' in instances[1] (did you mean 'device'?)"),
    ({"inputs": [{**X, "dtype": "FP32"}]}, "unknown key 'dtype' in inputs[0]"),
    ({"outputs": [tensor(shape=[-1, -1], pad={"axis": 1, "valeu": 0})]},
     "unknown key 'valeu' in outputs[0].pad (did you mean 'value'?)"),
    ({"zzz": 1}, "unknown key 'zzz' (known keys: backend, batching, "),
    ({1: 2}, "unknown key 1 (known keys: "),
    ({"backend": "tensorflow"},
     "backend must be one of onnx, python, torch_export, torchscript, got 'tensorflow'"),
    ({"parameters": {"threads": "4"}, "backend": "onnx"},
     "parameters.threads must be an integer >= 1, got '4'"),
    ({"parameters": {"threads": 0}, "backend": "torchscript"}, "parameters.threads must be"),
])
def test_a_bad_value_names_the_folder_the_key_and_the_reason(raw: dict[str, Any],
                                                             expected: str) -> None:
    assert expected in refused(raw)


def test_without_a_backend_key_or_artifact_the_backend_is_asked_for() -> None:
    assert "backend must be one of" in refused({}, backend=None)
    assert "no backend key and no model artifact" in refused({}, backend=None)


def test_every_problem_is_reported_at_once_up_to_five() -> None:
    message = refused({"max_batch_size": "1", "queue": {"priority_levels": "2"}})
    assert "max_batch_size must" in message and "queue.priority_levels must" in message
    many = refused({f"k{i}": i for i in range(8)})
    assert many.count("unknown key") == 5 and many.endswith("; and 3 more")


def test_a_huge_value_is_shortened_in_the_message() -> None:
    message = refused({"max_batch_size": "9" * 10_000})
    assert len(message) < 300


@pytest.mark.parametrize("raw", [
    {"batching": None, "queue": None, "inputs": None, "outputs": None, "instances": None,
     "parameters": None},
    {"instances": []},
])
def test_empty_sections_take_the_defaults(raw: dict[str, Any]) -> None:
    assert ModelConfig.from_dict("m", raw, "python") == ModelConfig("m", "python")


def test_the_schema_defaults_are_the_dataclass_defaults() -> None:
    config = ModelConfig.from_dict("m", {}, "onnx")
    assert config == ModelConfig(name="m", backend="onnx")
    assert config.instances == (InstanceGroup(),)
    assert (config.batching, config.queue) == (BatchingConfig(), QueueConfig())


def test_a_full_config_becomes_the_dataclasses() -> None:
    config = ModelConfig.from_dict("full", {
        "backend": "python", "platform": "python", "max_batch_size": 16,
        "inputs": [{"name": "t", "datatype": "INT64", "shape": [-1, -1],
                    "pad": {"axis": 1, "value": 7}}],
        "outputs": [{"name": "o", "datatype": "FP16", "shape": [-1, -1], "pad": {"axis": 1}}],
        "batching": {"max_queue_delay_us": 100, "preferred_batch_sizes": [4, 8],
                     "latency_target_ms": 20, "adaptive": False},
        "queue": {"priority_levels": 5, "default_priority": 5, "max_queue_rows": 64,
                  "default_timeout_ms": 1000},
        "execution_timeout_s": 3, "max_batch_cost": 4096, "max_deliveries": 1,
        "instances": [{"device": "cuda:1", "count": 2}, {"device": "cpu"}],
        "parameters": {"threads": "any value for a python model", "nested": {"a": [1]}},
    })
    assert config.inputs == (TensorSpec("t", "INT64", (-1, -1), 1, 7.0),)
    assert config.outputs == (TensorSpec("o", "FP16", (-1, -1), 1, 0.0),)
    assert config.batching == BatchingConfig(100, (4, 8), 20.0, False, "lifo")
    assert config.queue == QueueConfig(5, 5, 64, 1000)
    assert config.instances == (InstanceGroup("cuda:1", 2), InstanceGroup("cpu", 1))
    assert (config.execution_timeout_s, config.max_batch_cost, config.max_deliveries) == (
        3.0, 4096.0, 1)
    assert isinstance(config.execution_timeout_s, float)
    assert config.parameters == {"threads": "any value for a python model", "nested": {"a": [1]}}


def write(folder: Path, text: str | bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text("class Model: ...\n")
    data = text if isinstance(text, bytes) else text.encode()
    (folder / "config.yaml").write_bytes(data)
    return folder


@pytest.mark.parametrize("text,expected", [
    ("backend: python\nqueue:\n  priority_levels: 3\n   default_priority: 2\n",
     "config.yaml line 4, column 20: mapping values are not allowed here"),
    ("inputs: [{name: x\n", "config.yaml line 2, column 1: "),
    ("- backend: python\n", "config.yaml line 1: must be a mapping of keys, got a list"),
    ("# a comment\n\n42\n", "config.yaml line 3: must be a mapping of keys, got an integer"),
    ("just text\n", "config.yaml line 1: must be a mapping of keys, got a string"),
    ("backend: python\n---\nbackend: onnx\n", "config.yaml line 2, column 1: expected a single "
     "document in the stream, but found another document"),
    ("backend: python\nmax_batch_size: 4\nmax_batch_size: 8\n",
     "config.yaml line 3: duplicate key 'max_batch_size'"),
    ("queue: {default_priority: 1, default_priority: 2}\n",
     "config.yaml line 1: duplicate key 'default_priority'"),
    (b"backend: python\n\xff\xfe\n", "config.yaml line 2: not UTF-8 text"),
    ("backend: python\nx: \x07\n", "config.yaml line 2: not UTF-8 text or a special character"),
    ("a: !!python/object/apply:os.system [ls]\n", "config.yaml line 1, column 4: could not "
     "determine a constructor"),
    ("a: *nowhere\n", "config.yaml line 1, column 4: found undefined alias 'nowhere'"),
    ("a: " + "[" * 5000 + "\n", "config.yaml nests too deeply"),
    ("queue:\n  priority_levels: \"3\"\n",
     "queue.priority_levels must be an integer, got '3' (a quoted string"),
    ("instances:\n  - {device: cpu, count: \"2\"}\n", "instances[0].count must be an integer"),
    ("batching: {latency_target_ms: \"50\"}\n", "batching.latency_target_ms must be a number"),
    ("max_batch_size: yes\n", "max_batch_size must be an integer, got True (a boolean)"),
])
def test_load_model_config_raises_config_error_with_the_folder_and_line(
        tmp_path: Path, text: str | bytes, expected: str) -> None:
    folder = write(tmp_path / "secret_dir" / "broken", text)
    with pytest.raises(ConfigError) as caught:
        load_model_config(folder)
    message = str(caught.value)
    assert message.startswith("broken: ") and expected in message, message
    assert "secret_dir" not in message and str(tmp_path) not in message
    assert caught.value.__context__ is None or caught.value.__suppress_context__


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n", "~\n"])
def test_an_empty_config_yaml_is_an_empty_mapping(tmp_path: Path, text: str) -> None:
    assert load_model_config(write(tmp_path / "m", text)) == ModelConfig("m", "python")


def test_an_unreadable_config_yaml_names_no_path(tmp_path: Path) -> None:
    folder = write(tmp_path / "hidden" / "m", "backend: python\n")
    (folder / "config.yaml").unlink()
    (folder / "config.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"^m: config.yaml cannot be read \(Is a directory\)$"):
        load_model_config(folder)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_a_config_yaml_without_read_permission_names_no_path(tmp_path: Path) -> None:
    folder = write(tmp_path / "hidden" / "m", "backend: python\n")
    (folder / "config.yaml").chmod(0)
    with pytest.raises(ConfigError, match=r"^m: config.yaml cannot be read \(Permission denied\)$"):
        load_model_config(folder)


BUNDLED = sorted(str(p.relative_to(ROOT)) for base in ("models", "tests")
                 for p in (ROOT / base).rglob("config.yaml"))


@pytest.mark.parametrize("path", BUNDLED)
def test_every_bundled_config_still_parses(path: str) -> None:
    folder = (ROOT / path).parent
    assert load_model_config(folder).name == folder.name
