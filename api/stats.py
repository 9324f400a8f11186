"""Inference statistics in Triton's form (``/stats``, gRPC ModelStatistics).

The workers add to one hash per model (``Keys.stats``) with every batch they run, so
the numbers are the sum over every worker and inference process. What is measured:

* ``success``, ``fail``: requests answered, and the time from enqueue to answer;
* ``queue``: time from enqueue until the request's batch started;
* ``compute_input``, ``compute_infer``, ``compute_output``: the batch's time stacking
  (and padding) its inputs, in the model, and splitting and packing its outputs, each
  counted once per request in the batch, as Triton counts them;
* ``batch_stats``: per executed batch size, executions and their time in each phase.

``last_inference`` is when a worker last finished a batch (ms since the epoch; workers
set it, so it is the latest of theirs). ``cache_hit``/``cache_miss`` are zero (conveyor
has no response cache).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from batching.errors import Unavailable
from batching.keys import COMPUTE_PHASES, Keys
from batching.redis_errors import REDIS_FAILED

_ZERO = {"count": 0, "ns": 0}



async def statistics(redis: Redis, keys: Keys, models: list[str]) -> dict[str, Any]:
    """``{"model_stats": [...]}`` for ``models``, one Redis round trip."""
    try:
        pipe = redis.pipeline(transaction=False)
        for model in models:
            pipe.hgetall(keys.stats(model))
        hashes: list[dict[bytes, bytes]] = await pipe.execute()
    except REDIS_FAILED as exc:
        raise Unavailable(f"Redis is unreachable: {exc}") from None
    return {"model_stats": [model_statistics(model, raw)
                            for model, raw in zip(models, hashes, strict=True)]}


def model_statistics(model: str, raw: dict[bytes, bytes]) -> dict[str, Any]:
    counters = {key.decode(): int(value) for key, value in raw.items()}

    def duration(name: str) -> dict[str, int]:
        return {"count": counters.get(f"{name}_count", 0), "ns": counters.get(f"{name}_ns", 0)}

    batches: list[dict[str, Any]] = []
    for key, count in counters.items():
        kind, _, rest = key.partition(":")
        rows, _, what = rest.partition(":")
        if kind == "batch" and what == "count" and rows.isdigit():
            batches.append({"batch_size": int(rows), **{
                phase: {"count": count, "ns": counters.get(f"batch:{rows}:{phase}_ns", 0)}
                for phase in COMPUTE_PHASES}})
    batches.sort(key=lambda b: b["batch_size"])
    return {
        "name": model,
        "version": "1",
        "last_inference": counters.get("last_inference", 0),
        "inference_count": counters.get("inference_count", 0),
        "execution_count": counters.get("execution_count", 0),
        "inference_stats": {
            "success": duration("success"),
            "fail": duration("fail"),
            "queue": duration("queue"),
            **{phase: duration(phase) for phase in COMPUTE_PHASES},
            "cache_hit": dict(_ZERO),
            "cache_miss": dict(_ZERO),
        },
        "batch_stats": batches,
    }
