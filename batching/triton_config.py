"""A model's configuration in Triton's ModelConfig JSON form (``/config``, gRPC ModelConfig).

Triton's ``dims`` leave out the batch dim when ``max_batch_size > 0``; conveyor's shapes
carry it first, so ``dims`` is the shape less its first entry (the whole shape when
``max_batch_size`` is 0). Knobs Triton has no field for (the adaptive policy, its latency
target, the execution timeout, priority aging) appear as ``parameters`` named
``conveyor.*``, beside the model's own ``parameters``.
"""

from __future__ import annotations

from typing import Any

from batching.config import ModelConfig, TensorSpec
from batching.ensemble import WHEN, EnsemblePlan

_PLATFORM = {
    "onnx": ("onnxruntime_onnx", "onnxruntime"),
    "torchscript": ("pytorch_libtorch", "pytorch"),
    "torch_export": ("pytorch_torch_export", "pytorch"),
    "python": ("", "python"),
}


def data_type(datatype: str) -> str:
    """KServe datatype name -> Triton's ``DataType`` enum name (BYTES is TYPE_STRING)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def triton_config(config: ModelConfig) -> dict[str, Any]:
    platform, backend = _PLATFORM[config.backend]
    queue = config.queue
    parameters = {str(key): {"string_value": str(value)}
                  for key, value in config.parameters.items()}
    parameters.update({
        "conveyor.adaptive": {"string_value": str(config.batching.adaptive).lower()},
        "conveyor.latency_target_ms": {"string_value": f"{config.batching.latency_target_ms:g}"},
        "conveyor.execution_timeout_s": {"string_value": f"{config.execution_timeout_s:g}"},
    })
    if queue.max_priority_wait_ms is not None:
        parameters["conveyor.max_priority_wait_ms"] = {
            "string_value": str(queue.max_priority_wait_ms)}
    return {
        "name": config.name,
        "platform": platform,
        "backend": backend,
        "max_batch_size": config.max_batch_size,
        "version_policy": _version_policy(config),
        "input": [{"name": t.name, "data_type": data_type(t.datatype), "format": "FORMAT_NONE",
                   "dims": _dims(config, t), **_reshape(t)} for t in config.inputs],
        "output": [{"name": t.name, "data_type": data_type(t.datatype),
                    "dims": _dims(config, t), **_reshape(t)} for t in config.outputs],
        "dynamic_batching": {
            "preferred_batch_size": list(config.batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": config.batching.max_queue_delay_us,
            "preserve_ordering": False,
            "priority_levels": queue.priority_levels,
            "default_priority_level": queue.default_priority,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": queue.default_timeout_ms * 1000,
                "allow_timeout_override": True,
                "max_queue_size": queue.max_queue_rows,
            },
        },
        "instance_group": [_instance_group(config.name, i, group.device, group.count)
                           for i, group in enumerate(config.instances)],
        "default_model_filename": config.artifact,
        "parameters": parameters,
    }


def ensemble_config(plan: EnsemblePlan) -> dict[str, Any]:
    """An ensemble's ModelConfig as Triton shows it: its tensors, its steps (a step's
    ``model_version`` -1 is the newest) and the steps' conditions as ``parameters``."""
    config = plan.config
    return {
        "name": config.name,
        "platform": "ensemble",
        "backend": "",
        "max_batch_size": config.max_batch_size,
        "input": [{"name": t.name, "data_type": data_type(t.datatype), "format": "FORMAT_NONE",
                   "dims": _dims(config, t)} for t in config.inputs],
        "output": [{"name": t.name, "data_type": data_type(t.datatype),
                    "dims": _dims(config, t)} for t in config.outputs],
        "ensemble_scheduling": {"step": [
            {"model_name": step.model, "model_version": int(step.version or -1),
             "input_map": dict(step.inputs), "output_map": dict(step.outputs)}
            for step in plan.steps]},
        "parameters": {f"{WHEN}{step.model}": {"string_value": step.when.describe()}
                       for step in plan.steps if step.when is not None},
    }


def _dims(config: ModelConfig, spec: TensorSpec) -> list[int]:
    return list(spec.shape[1:] if config.batched else spec.shape)


def _reshape(spec: TensorSpec) -> dict[str, Any]:
    return {} if spec.reshape is None else {"reshape": {"shape": list(spec.reshape)}}


def _version_policy(config: ModelConfig) -> dict[str, Any]:
    policy = config.version_policy
    if policy.kind == "all":
        return {"all": {}}
    if policy.kind == "specific":
        return {"specific": {"versions": list(policy.specific)}}
    return {"latest": {"num_versions": policy.latest}}


def _instance_group(model: str, index: int, device: str, count: int) -> dict[str, Any]:
    group: dict[str, Any] = {"name": f"{model}_{index}", "count": count}
    if device.startswith("cuda"):
        group["kind"] = "KIND_GPU"
        group["gpus"] = [int(device.partition(":")[2] or 0)]
    else:
        group["kind"] = "KIND_CPU"
        group["gpus"] = []
    return group
