"""Ensembles read from config.pbtxt and checked against their step models (batching/ensemble.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from batching.config import ConfigError, ModelConfig, TensorSpec
from batching.ensemble import EnsemblePlan, plan_ensemble, read_ensemble
from batching.ensemble_when import read_condition
from batching.repository_scan import load_model_config, scan_repository
from batching.triton_config import ensemble_config

ROOT = Path(__file__).resolve().parents[2]
SIMPLE = ModelConfig("simple", "python", 8,
                     (TensorSpec("INPUT0", "INT32", (-1, 16)), TensorSpec("INPUT1", "INT32", (-1, 16))),
                     (TensorSpec("OUTPUT0", "INT32", (-1, 16)),
                      TensorSpec("OUTPUT1", "INT32", (-1, 16))))
FLOATS = ModelConfig("floats", "python", 8, (TensorSpec("x", "FP32", (-1, 16)),),
                     (TensorSpec("y", "FP32", (-1, 16)),))
MODELS = {"simple": SIMPLE, "floats": FLOATS}


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = "".join(f'input_map {{ key: "{k}" value: "{v}" }} ' for k, v in inputs.items())
    maps += "".join(f'output_map {{ key: "{k}" value: "{v}" }} ' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1 {maps}}}'


def ensemble(*steps: str, outputs: str = "OUT", extra: str = "", batch: int = 8) -> str:
    return (f'name: "ens" platform: "ensemble" max_batch_size: {batch} '
            'input [ { name: "A" data_type: TYPE_INT32 dims: [ 16 ] }, '
            '{ name: "B" data_type: TYPE_INT32 dims: [ 16 ] } ] '
            f'output [ {{ name: "{outputs}" data_type: TYPE_INT32 dims: [ 16 ] }} ] '
            f'ensemble_scheduling {{ step [ {", ".join(steps)} ] }} {extra}')


def plan(text: str) -> EnsemblePlan:
    return plan_ensemble(read_ensemble("ens", text.encode()), MODELS)


FIRST = step("simple", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "S", "OUTPUT1": "D"})


def test_steps_are_ordered_in_stages_from_their_maps() -> None:
    second = step("simple", {"INPUT0": "S", "INPUT1": "D"}, {"OUTPUT0": "OUT"})
    side = step("simple", {"INPUT0": "A", "INPUT1": "A"}, {"OUTPUT1": "ZERO"})
    planned = plan(ensemble(second, FIRST, side))  # written out of order
    assert [[s.inputs for s in stage] for stage in planned.stages] == [
        [{"INPUT0": "A", "INPUT1": "B"}, {"INPUT0": "A", "INPUT1": "A"}],
        [{"INPUT0": "S", "INPUT1": "D"}]]
    config = planned.config
    assert config.backend == "ensemble" and config.max_batch_size == 8
    assert [t.describe() for t in config.inputs] == ["A INT32 [-1, 16]", "B INT32 [-1, 16]"]
    shown = ensemble_config(planned)
    assert shown["platform"] == "ensemble" and shown["input"][0]["dims"] == [16]
    assert shown["ensemble_scheduling"]["step"][0] == {
        "model_name": "simple", "model_version": -1, "output_map": {"OUTPUT0": "OUT"},
        "input_map": {"INPUT0": "S", "INPUT1": "D"}}


@pytest.mark.parametrize("text,expected", [
    (ensemble(step("missing", {"x": "A"}, {"y": "OUT"})),
     "ens: ensemble step 'missing': model 'missing' is not loaded"),
    (ensemble(step("simple", {"INPUT0": "A"}, {"OUTPUT0": "OUT"})),
     "step 'simple': input 'INPUT1' of model 'simple' is not mapped"),
    (ensemble(step("simple", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "OUT", "OUTPUT1": "A"})),
     "output 'OUTPUT1' maps to 'A', which another step or the ensemble's input"),
    (ensemble(step("simple", {"INPUT0": "A", "INPUT1": "Y"}, {"OUTPUT0": "X"}),
              step("simple", {"INPUT0": "A", "INPUT1": "X"}, {"OUTPUT0": "Y", "OUTPUT1": "OUT"})),
     "steps 'simple', 'simple' form a cycle"),
    (ensemble(step("simple", {"INPUT0": "A", "INPUT1": "C"}, {"OUTPUT0": "OUT"})),
     "'C' is neither an input of the ensemble nor an output of a step"),
    (ensemble(step("floats", {"x": "A"}, {"y": "OUT"})),
     "step 'floats': input 'x' is FP32, but 'A' is INT32"),
    (ensemble(FIRST, outputs="NONE"), "ens: ensemble: output 'NONE' is the output of no step"),
    (ensemble(step("simple", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT9": "OUT"})),
     "model 'simple' has no output 'OUTPUT9' (its outputs: OUTPUT0, OUTPUT1)"),
    (ensemble(FIRST, batch=16), "the ensemble's max_batch_size 16 does not fit the model's 8"),
    (ensemble(FIRST, extra='parameters { key: "other" value { string_value: "1" } }'),
     "parameter 'other' is not supported on an ensemble"),
    (ensemble(FIRST, extra='parameters { key: "conveyor.when:simple" value '
                           '{ string_value: "S >> 1" } }'),
     "conveyor.when:simple: 'S >> 1' is not '<tensor> <op> <number>'"),
    (ensemble(FIRST, extra='dynamic_batching { }'), "dynamic_batching is not supported"),
])
def test_refused_by_name(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        plan(text)
    assert expected in str(caught.value)


def test_shape_mismatch_is_refused() -> None:
    narrow = ModelConfig("narrow", "python", 8, (TensorSpec("x", "INT32", (-1, 8)),),
                         (TensorSpec("y", "INT32", (-1, 16)),))
    draft = read_ensemble("ens", ensemble(step("narrow", {"x": "A"}, {"y": "OUT"})).encode())
    with pytest.raises(ConfigError, match=r"input 'x' has shape \[-1, 8\], but 'A' has "
                                          r"\[-1, 16\]"):
        plan_ensemble(draft, {"narrow": narrow})


def test_a_condition_orders_its_step_after_the_tensor_it_reads() -> None:
    gated = step("floats", {"x": "F"}, {"y": "G"})
    making = step("simple", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "OUT", "OUTPUT1": "N"})
    text = ensemble(gated, making, extra='parameters { key: "conveyor.when:floats" '
                                         'value { string_value: "N != 0" } }')
    text = text.replace('{ name: "B" data_type: TYPE_INT32 dims: [ 16 ] } ]',
                        '{ name: "B" data_type: TYPE_INT32 dims: [ 16 ] }, '
                        '{ name: "F" data_type: TYPE_FP32 dims: [ 16 ] } ]')
    planned = plan(text)
    assert [[s.model for s in stage] for stage in planned.stages] == [["simple"], ["floats"]]
    when = planned.stages[1][0].when
    assert when is not None and when.describe() == "N != 0"
    assert ensemble_config(planned)["parameters"] == {
        "conveyor.when:floats": {"string_value": "N != 0"}}


def test_condition_holds_when_some_element_compares_true() -> None:
    import numpy as np

    assert read_condition("count > 0").holds(np.array([[0], [2]]))
    assert not read_condition(" count>0 ").holds(np.array([[0], [0]]))
    assert not read_condition("count == 1.5").holds(np.zeros((0, 1)))


def test_the_scan_serves_an_ensemble_without_a_worker_and_fails_one_whose_step_fails(
        tmp_path: Path) -> None:
    for name in ("add_sub_twice", "pipeline", "decode", "classify", "topk"):
        shutil.copytree(ROOT / "tests" / "ensemble_models" / name, tmp_path / name)
    shutil.copytree(ROOT / "tests" / "protocol_models" / "simple", tmp_path / "simple")
    (tmp_path / "topk" / "config.yaml").write_text("max_batch_size: nope\n")
    scan = scan_repository(tmp_path)
    assert sorted(scan.models) == ["classify", "decode", "simple"]
    assert sorted(scan.ensembles) == ["add_sub_twice"]
    assert scan.failed["pipeline"].startswith("pipeline: ensemble step 'topk': model 'topk' "
                                              "is not loaded")
    assert [[s.model for s in stage] for stage in scan.ensembles["add_sub_twice"].stages] == [
        ["simple"], ["simple"]]


def test_an_ensemble_folder_is_no_model_and_says_why(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "tests" / "ensemble_models" / "add_sub_twice",
                    tmp_path / "add_sub_twice")
    with pytest.raises(ConfigError, match="step 'simple': model 'simple' is not loaded"):
        load_model_config(tmp_path / "add_sub_twice")
    shutil.copytree(ROOT / "tests" / "protocol_models" / "simple", tmp_path / "simple")
    with pytest.raises(ConfigError, match="add_sub_twice: an ensemble is no model of its own"):
        load_model_config(tmp_path / "add_sub_twice")
