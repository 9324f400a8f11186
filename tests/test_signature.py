import pytest

from batching.config import ADAPTIVE_BOUND_US, BatchingConfig, ConfigError, ModelConfig
from batching.errors import InvalidInput
from batching.names import requested_version
from batching.signature import check_inputs

CONFIG = ModelConfig.from_dict("m", {
    "backend": "python", "max_batch_size": 8,
    "inputs": [{"name": "a", "datatype": "FP32", "shape": [-1, 3]},
               {"name": "b", "datatype": "INT64", "shape": [-1, -1]}],
})


def test_valid_request_returns_rows() -> None:
    assert check_inputs(CONFIG, [("a", "FP32", (2, 3)), ("b", "INT64", (2, 7))]) == 2


@pytest.mark.parametrize("given,message", [
    ([("a", "FP32", (1, 3)), ("c", "INT64", (1, 1))], "unexpected inference input 'c' for model 'm'"),
    ([("a", "FP32", (1, 3))], "expected 2 inputs but got 1 inputs for model 'm'. Got input(s) "
     "['a'], but missing required input(s) ['b']. Please provide all required input(s)."),
    ([("a", "FP32", (1, 3)), ("a", "FP32", (1, 3))], "input 'a' already exists in request"),
    ([("a", "FP64", (1, 3)), ("b", "INT64", (1, 1))],
     "inference input 'a' data-type is 'FP64', but model 'm' expects 'FP32'"),
    ([("a", "FP32", (1, 3, 1)), ("b", "INT64", (1, 1))],
     "unexpected shape for input 'a' for model 'm'. Expected [-1,3], got [1,3,1]"),
    ([("a", "FP32", (1, 4)), ("b", "INT64", (1, 1))],
     "unexpected shape for input 'a' for model 'm'. Expected [-1,3], got [1,4]"),
    ([("a", "FP32", (2, 3)), ("b", "INT64", (1, 1))],
     "input 'b' batch size does not match other inputs for 'm'"),
    ([("a", "FP32", ()), ("b", "INT64", (1, 1))],
     "input 'a' has no shape but model requires batch dimension for 'm'"),
    ([("a", "FP32", (9, 3)), ("b", "INT64", (9, 1))], "inference request batch-size must be <= 8 for 'm'"),
    ([("a", "FP32", (0, 3)), ("b", "INT64", (0, 1))], "at least 1"),
])
def test_invalid_requests_name_the_input_and_expectation(given: list[tuple[str, str, tuple[int, ...]]],
                                                        message: str) -> None:
    """Worded as Triton words them: its clients and tests match the text."""
    with pytest.raises(InvalidInput) as caught:
        check_inputs(CONFIG, given)
    assert message in caught.value.message


def test_config_rejects_unknown_keys_and_bad_backend() -> None:
    with pytest.raises(ConfigError, match="unknown key 'max_batch'"):
        ModelConfig.from_dict("m", {"backend": "python", "max_batch": 3})
    with pytest.raises(ConfigError, match="backend must be one of"):
        ModelConfig.from_dict("m", {})


def test_the_wait_bound_defaults_by_policy() -> None:
    """Unset, the adaptive policy may wait up to ADAPTIVE_BOUND_US; a fixed window is 0
    (take what is waiting); a value given is kept, 0 included."""
    fixed = ModelConfig.from_dict("m", {"batching": {"adaptive": False}}, backend="onnx")
    assert fixed.batching.max_queue_delay_us == 0
    assert BatchingConfig(adaptive=False).max_queue_delay_us == 0
    assert BatchingConfig().max_queue_delay_us == ADAPTIVE_BOUND_US
    for adaptive in (True, False):
        for given in (0, 500):
            config = ModelConfig.from_dict(
                "m", {"batching": {"adaptive": adaptive, "max_queue_delay_us": given}}, backend="onnx")
            assert config.batching.max_queue_delay_us == given


def test_config_defaults_follow_the_design() -> None:
    config = ModelConfig.from_dict("m", {}, backend="onnx")
    assert config.batching.adaptive and config.batching.max_queue_delay_us == ADAPTIVE_BOUND_US == 20000
    assert config.queue.priority_levels == 3 and config.queue.default_priority == 2
    assert config.queue.default_timeout_ms == 30000
    assert config.instances[0].device == "cpu"


@pytest.mark.parametrize("version,number", [("", None), ("1", 1), ("0", 0), ("07", 7)])
def test_versions_are_ascii_digits(version: str, number: int | None) -> None:
    assert requested_version(version) == number


@pytest.mark.parametrize("version,message", [
    ("x", "failed to get model version from specified version string 'x' (details: not an "
          "integer), version should be an integral value > 0"),
    ("1_0", "failed to get model version from specified version string '1_0'"),
    (" 1", "failed to get model version from specified version string ' 1'"),
    ("-1", "invalid model version specified '-1' , version should be an integral value > 0"),
])
def test_bad_versions_in_tritons_words(version: str, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        requested_version(version)
    assert caught.value.message.startswith(message)
