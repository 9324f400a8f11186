"""The metrics of state every API process shares: read from Redis and heartbeats.

:meth:`SharedState.refresh` reads, in one pipelined round trip, each model's stream
lengths, oldest unread entries (queue_age.lua), rows waiting and stats hash, and the job
counts; :meth:`SharedState.collect` yields them, with the figures of the heartbeats the
API's worker watch last read, as Prometheus families (api/metric_defs.py names them all).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis

from api import metric_defs as d
from batching.config import ModelConfig
from batching.histograms import (
    BATCH_BUCKETS,
    LATENCY_BUCKETS,
    batch_sizes,
    cumulative,
    execution_times,
)
from batching.job_record import FINISHED, JobState
from batching.keys import GROUP, Keys
from batching.lua import script
from batching.redis_errors import REDIS_FAILED

QUEUE_AGE_LUA = script("queue_age").text
WORKER_TOTALS = ((d.OOM, "oom_count"), (d.RECLAIMED, "reclaimed_count"),
                 (d.DEAD_LETTER, "dead_letter_count"), (d.WITHDRAWN, "withdrawn_count"),
                 (d.SHED, "shed_count"),
                 (d.RESTARTS, "restart_count"),
                 (d.ROWS, "inference_count"), (d.JOB_ROWS, "job_rows"))
"""Counters the workers keep in each model's stats hash, exposed per model."""
WORKER_GAUGES = (
    (d.ROW_CAP, ("row_cap",)),
    (d.ARRIVAL_RATE, ("policy", "arrival_rate_per_s")),
    (d.LATENCY_INTERCEPT, ("policy", "latency_a_s")),
    (d.LATENCY_SLOPE, ("policy", "latency_b_s_per_row")),
    (d.SHED_RESERVE, ("policy", "shed_reserve_s")),
)
"""Per-process figures from heartbeats, labelled by model and consumer."""
MODEL_STATES = ("READY", "LOADING", "UNAVAILABLE")
"""Values of the ``state`` label of ``conveyor_model_state`` (Triton's repository states)."""
INSTANCE_STATES = {"ready": "ready", "loading": "loading", "restarting": "loading",
                   "failed": "failed"}
"""Heartbeat states (of a process, or of its supervisor's slot) -> the exported state."""
SLOT = ":slot"
"""How the name of a supervisor's slot beat ends (workers/supervisor.py)."""


class SharedState(Collector):
    """Yields the values :meth:`refresh` last read from Redis."""

    def __init__(self) -> None:
        self.depth: dict[tuple[str, str], int] = {}
        self.oldest_s: dict[tuple[str, str], float] = {}
        self.waiting: dict[str, int] = {}
        self.totals: dict[str, dict[str, int]] = {}
        self.jobs: dict[str, int] = {}
        self.beats: dict[str, list[dict[str, Any]]] = {}
        self.model_states: dict[str, str] = {}
        self.redis_up = False

    async def refresh(self, redis: Redis, keys: Keys, models: Mapping[str, ModelConfig],
                      beats: Mapping[str, list[dict[str, Any]]]) -> None:
        """Read the shared state (one round trip); keep the last on failure.

        ``beats``: each model's fresh heartbeats, as the API's worker watch last read them.
        """
        self.beats = dict(beats)
        names = sorted(models)
        levels = {m: models[m].queue.priority_levels for m in names}
        parts = {m: models[m].queue.partitions for m in names}
        pipe = redis.pipeline(transaction=False)
        for model in names:
            for part in range(parts[model]):  # each partition is a slot of its own
                queues = keys.queues(model, levels[model], part)
                for stream in queues:
                    pipe.xlen(stream)
                pipe.eval(QUEUE_AGE_LUA, len(queues), *queues, GROUP)
                pipe.get(keys.rows_waiting(model, part))
            pipe.hgetall(keys.stats(model))
        pipe.hgetall(keys.jobs_counted())
        try:
            results = iter(await pipe.execute())
        except REDIS_FAILED:
            self.redis_up = False
            return
        self.redis_up = True
        depth: dict[tuple[str, str], int] = {}
        oldest: dict[tuple[str, str], float] = {}
        waiting, totals = {}, {}
        for model in names:
            priorities = [str(p) for p in range(1, levels[model] + 1)]
            waiting[model] = 0
            for _ in range(parts[model]):  # depths and rows summed, the oldest of any
                for p in priorities:
                    depth[model, p] = depth.get((model, p), 0) + int(next(results))
                now_ms, *first = next(results)
                for p, entry in zip(priorities, first, strict=True):
                    oldest[model, p] = max(oldest.get((model, p), 0.0),
                                           _age_s(int(now_ms), entry))
                waiting[model] += max(0, int(next(results) or 0))
            totals[model] = _ints(next(results))
        self.depth, self.oldest_s, self.waiting, self.totals = depth, oldest, waiting, totals
        self.jobs = _ints(next(results))

    def collect(self) -> Iterator[Metric]:
        up = d.REDIS_UP.family()
        up.add_metric([], float(self.redis_up))
        yield up
        yield self._model_states()
        yield from self._queues()
        for metric, key in WORKER_TOTALS:
            family = metric.family()
            for model, counters in sorted(self.totals.items()):
                family.add_metric([model], counters.get(key, 0))
            yield family
        yield from self._batches()
        yield from self._jobs()
        yield from self._instances()
        yield from self._gauges()

    def _model_states(self) -> Metric:
        """One series per model folder and state: 1 for the state it is in, 0 otherwise."""
        family = d.MODEL_STATE.family()
        for model, current in sorted(self.model_states.items()):
            for state in MODEL_STATES:
                family.add_metric([model, state], float(state == current))
        return family

    def _queues(self) -> Iterator[Metric]:
        depth, oldest = d.QUEUE_DEPTH.family(), d.QUEUE_OLDEST_AGE.family()
        drain = d.QUEUE_DRAIN.family()
        for (model, priority), value in sorted(self.depth.items()):
            depth.add_metric([model, priority], value)
            oldest.add_metric([model, priority], self.oldest_s.get((model, priority), 0.0))
        for model, rows in sorted(self.waiting.items()):
            drain.add_metric([model], drain_s(rows, self.beats.get(model, [])))
        yield from (depth, oldest, drain)

    def _batches(self) -> Iterator[Metric]:
        """Batch sizes, execution times, why batches were dispatched, how long they waited."""
        sizes, execution = d.BATCH_SIZE.histogram(), d.BATCH_EXECUTION.histogram()
        reasons, wait = d.BATCHES.family(), d.BATCH_WAIT.family()
        for model, counters in sorted(self.totals.items()):
            by_size = batch_sizes(counters)
            sizes.add_metric([model], cumulative(by_size, BATCH_BUCKETS),
                             sum(rows * n for rows, n in by_size.items()))
            busy_ns = sum(v for k, v in counters.items()
                          if k.startswith("batch:") and k.endswith(":ns"))
            execution.add_metric([model],
                                 cumulative(execution_times(counters), LATENCY_BUCKETS),
                                 busy_ns / 1e9)
            for key, value in sorted(counters.items()):
                if key.startswith("reason:"):
                    reasons.add_metric([model, key.removeprefix("reason:")], value)
            wait.add_metric([model], counters.get("wait_ns", 0) / 1e9)
        yield from (sizes, execution, reasons, wait)

    def _jobs(self) -> Iterator[Metric]:
        jobs, finished = d.JOBS.family(), d.JOBS_FINISHED.family()
        for state in (JobState.PENDING, JobState.RUNNING):
            jobs.add_metric([state.value], max(0, self.jobs.get(state.value, 0)))
        for state in sorted(FINISHED):
            finished.add_metric([state.value], self.jobs.get(state.value, 0))
        yield from (jobs, finished)

    def _instances(self) -> Iterator[Metric]:
        """Each inference process's state, and its resident memory."""
        states, memory = d.INSTANCE_STATE.family(), d.RESIDENT_MEMORY.family()
        for model, beats in sorted(self.beats.items()):
            for beat in instances(beats):
                consumer = str(beat.get("consumer", ""))
                current = INSTANCE_STATES.get(str(beat.get("state")), "")
                for state in ("ready", "loading", "failed"):
                    states.add_metric([model, consumer, state], float(state == current))
                rss = beat.get("rss_bytes")
                if isinstance(rss, int):
                    memory.add_metric(["worker", model, consumer], rss)
        yield from (states, memory)

    def _gauges(self) -> Iterator[Metric]:
        for metric, path in WORKER_GAUGES:
            family = metric.family()
            for model, beats in sorted(self.beats.items()):
                for beat in beats:
                    value = _dig(beat, path)
                    if isinstance(value, int | float):
                        family.add_metric([model, str(beat.get("consumer", ""))], value)
            yield family
        used, total = d.GPU_USED.family(), d.GPU_TOTAL.family()
        seen = set()
        for beats in self.beats.values():
            for beat in beats:
                memory = beat.get("gpu_memory")
                where = (str(beat.get("host", "")), str(beat.get("device", "")))
                if isinstance(memory, dict) and where not in seen:
                    seen.add(where)
                    used.add_metric(list(where), memory.get("used", 0))
                    total.add_metric(list(where), memory.get("total", 0))
        yield from (used, total)


def drain_s(rows: int, beats: list[dict[str, Any]]) -> float:
    """Seconds ``rows`` take at the summed service rate of the ready processes; 0 for no
    rows, +Inf when none of them has a rate (none serves)."""
    if rows <= 0:
        return 0.0
    rate = sum(float(b.get("service_rows_per_s") or 0) for b in beats
               if b.get("state") == "ready")
    return rows / rate if rate > 0 else math.inf


def instances(beats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The heartbeats of inference processes, and of the supervisors' slots that have no
    process beating (a slot beats for its process while that one is being replaced, and
    goes on beating while the process loads)."""
    processes = {_slot_of(str(b.get("consumer", ""))) for b in beats
                 if not str(b.get("consumer", "")).endswith(SLOT)}
    return [b for b in beats if not str(b.get("consumer", "")).endswith(SLOT)
            or _slot_of(str(b["consumer"]).removesuffix(SLOT)) not in processes]


def _slot_of(consumer: str) -> tuple[str, str]:
    """``host:pid:model:device:index`` -> (host, "model:device:index"): what a process
    shares with its supervisor's slot."""
    host, _, rest = consumer.partition(":")
    return host, rest.partition(":")[2]


def _age_s(now_ms: int, entry: bytes | str) -> float:
    entry = entry.decode() if isinstance(entry, bytes) else entry
    if not entry:
        return 0.0
    return max(0.0, (now_ms - int(entry.partition("-")[0])) / 1000)


def _ints(raw: Mapping[bytes, bytes]) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in raw.items()}


def _dig(beat: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = beat
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value

