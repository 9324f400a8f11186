"""The API's Prometheus metrics (each one, with its name and labels, is in docs/metrics.md).

Most are counted by this process as it answers. With ``PROMETHEUS_MULTIPROC_DIR`` set
(prometheus_client's multiprocess mode, for ``uvicorn --workers N``), every process
writes its counts there and a scrape of any of them reports the sum over all. The rest
describe state shared by every process and are read from Redis when ``/metrics`` is
scraped (:meth:`ApiMetrics.refresh`): each model's stream lengths, and the totals the
workers keep in its stats hash.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from redis.asyncio import Redis

from batching.config import ModelConfig
from batching.keys import Keys
from batching.redis_errors import REDIS_FAILED

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                   5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PROTOCOLS = ("http_json", "http_binary", "grpc", "grpc_stream")
"""Values of the ``protocol`` label: how an inference request reached the API."""
WORKER_TOTALS = (
    ("conveyor_oom_total", "oom_count", "Batches that ran out of device memory (then split)"),
    ("conveyor_reclaimed_total", "reclaimed_count",
     "Entries reclaimed from a dead consumer and delivered again"),
    ("conveyor_dead_letter_total", "dead_letter_count",
     "Requests moved to the dead-letter stream past the delivery limit"),
    ("conveyor_withdrawn_total", "withdrawn_count",
     "Requests withdrawn unrun because their client left before the answer"),
    ("conveyor_worker_restarts_total", "restart_count",
     "Inference processes replaced after they died, hung or failed to load"),
)
WORKER_GAUGES = (
    ("conveyor_row_cap", ("row_cap",), "Learned row cap of an inference process (out of memory "
     "halves it, full batches probe it back up)"),
    ("conveyor_policy_arrival_rate", ("policy", "arrival_rate_per_s"),
     "Arrival rate (rows/s) the batching policy estimates"),
    ("conveyor_policy_latency_intercept_seconds", ("policy", "latency_a_s"),
     "Fixed cost a of the policy's batch latency model t(n) = a + b*n"),
    ("conveyor_policy_latency_slope_seconds", ("policy", "latency_b_s_per_row"),
     "Per-row cost b of the policy's batch latency model t(n) = a + b*n"),
)
"""Per-process figures from heartbeats, labelled by model and consumer."""
"""Counters the workers keep in each model's stats hash, exposed here per model."""
MODEL_STATES = ("READY", "LOADING", "UNAVAILABLE")
"""Values of the ``state`` label of ``conveyor_model_state`` (Triton's repository states)."""


class _SharedState(Collector):
    """Yields the values :meth:`ApiMetrics.refresh` last read from Redis."""

    def __init__(self) -> None:
        self.depth: dict[tuple[str, str], int] = {}
        self.totals: dict[str, dict[str, int]] = {}
        self.beats: dict[str, list[dict[str, Any]]] = {}
        self.model_states: dict[str, str] = {}

    def collect(self) -> Iterator[Metric]:
        yield self._model_states()
        depth = GaugeMetricFamily(
            "conveyor_queue_depth", "Entries in a model's request stream of one priority "
            "(waiting or being executed), read from Redis at scrape time",
            labels=["model", "priority"])
        for (model, priority), value in sorted(self.depth.items()):
            depth.add_metric([model, priority], value)
        yield depth
        for name, key, text in WORKER_TOTALS:
            family = CounterMetricFamily(name.removesuffix("_total"), text, labels=["model"])
            for model, counters in sorted(self.totals.items()):
                family.add_metric([model], counters.get(key, 0))
            yield family
        yield from self._decisions()
        yield from self._gauges()

    def _model_states(self) -> Metric:
        """One series per model folder and state: 1 for the state it is in, 0 otherwise."""
        family = GaugeMetricFamily(
            "conveyor_model_state", "Each model folder's repository state (READY, LOADING, "
            "UNAVAILABLE): 1 for the state it is in", labels=["model", "state"])
        for model, current in sorted(self.model_states.items()):
            for state in MODEL_STATES:
                family.add_metric([model, state], float(state == current))
        return family

    def _decisions(self) -> Iterator[Metric]:
        """Why batches were dispatched, how long they waited and how long they ran."""
        reasons = CounterMetricFamily(
            "conveyor_batches", "Executed batches by why they were dispatched (full, window, "
            "deadline, policy, drain)", labels=["model", "reason"])
        wait = CounterMetricFamily(
            "conveyor_batch_wait_seconds", "Time batches waited between the first entry read "
            "and dispatch, summed", labels=["model"])
        execution = SummaryMetricFamily(
            "conveyor_batch_execution_seconds", "Time the model took per executed batch",
            labels=["model"])
        for model, counters in sorted(self.totals.items()):
            for key, value in sorted(counters.items()):
                if key.startswith("reason:"):
                    reasons.add_metric([model, key.removeprefix("reason:")], value)
            wait.add_metric([model], counters.get("wait_ns", 0) / 1e9)
            busy_ns = sum(v for k, v in counters.items()
                          if k.startswith("batch:") and k.endswith(":ns"))
            execution.add_metric([model], counters.get("execution_count", 0), busy_ns / 1e9)
        yield from (reasons, wait, execution)

    def _gauges(self) -> Iterator[Metric]:
        for name, path, text in WORKER_GAUGES:
            family = GaugeMetricFamily(name, text, labels=["model", "consumer"])
            for model, beats in sorted(self.beats.items()):
                for beat in beats:
                    value = _dig(beat, path)
                    if isinstance(value, int | float):
                        family.add_metric([model, str(beat.get("consumer", ""))], value)
            yield family
        used = GaugeMetricFamily("conveyor_gpu_memory_used_bytes", "GPU memory in use",
                                 labels=["host", "device"])
        total = GaugeMetricFamily("conveyor_gpu_memory_total_bytes", "GPU memory in all",
                                  labels=["host", "device"])
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


def _dig(beat: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = beat
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


@dataclass(slots=True)
class ModelSeries:
    """One model's labelled children, looked up once: ``.labels()`` per request costs
    more than the observation itself."""

    model: str
    duration: Any
    queue: Any
    batch_size: Any
    requests: Any
    outcomes: dict[str, Any] = field(default_factory=dict)

    def outcome(self, outcome: str) -> Any:
        child = self.outcomes.get(outcome)
        if child is None:
            child = self.outcomes[outcome] = self.requests.labels(self.model, outcome)
        return child


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "conveyor_requests_total", "Inference requests answered, by outcome",
            ["model", "outcome"], registry=self.registry)
        self.protocol_requests = Counter(
            "conveyor_protocol_requests_total", "Inference requests received, by protocol "
            "(http_json, http_binary, grpc, grpc_stream)", ["protocol"], registry=self.registry)
        self.duration = Histogram(
            "conveyor_request_duration_seconds", "Time from request received to answer sent",
            ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram(
            "conveyor_queue_duration_seconds", "Time a request waited in its stream before "
            "its batch started", ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_size = Histogram(
            "conveyor_batch_size", "Rows in the batch each request ran in",
            ["model"], buckets=BATCH_BUCKETS, registry=self.registry)
        self._protocols = {p: self.protocol_requests.labels(p) for p in PROTOCOLS}
        self._series: dict[str, ModelSeries] = {}
        self._shared = _SharedState()
        self.registry.register(self._shared)

    def exposition(self) -> bytes:
        """The text a scrape gets: this process's counts, or every process's in
        multiprocess mode, then the shared state last read from Redis."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not directory:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, directory)  # type: ignore[no-untyped-call]
        registry.register(self._shared)
        return generate_latest(registry)

    def protocol(self, protocol: str) -> Any:
        return self._protocols.get(protocol) or self.protocol_requests.labels(protocol)

    def of(self, model: str) -> ModelSeries:
        series = self._series.get(model)
        if series is None:
            series = self._series[model] = ModelSeries(
                model, self.duration.labels(model), self.queue.labels(model),
                self.batch_size.labels(model), self.requests)
        return series

    def set_model_states(self, states: Mapping[str, str]) -> None:
        """Every model folder's repository state, as the index reports it."""
        self._shared.model_states = dict(states)

    async def refresh(self, redis: Redis, keys: Keys, models: Mapping[str, ModelConfig],
                      beats: Mapping[str, list[dict[str, Any]]]) -> None:
        """Read stream lengths and worker totals (one round trip); keep the last on failure.

        ``beats``: each model's fresh heartbeats, as the API's worker watch last read them.
        """
        self._shared.beats = dict(beats)
        names = sorted(models)
        pipe = redis.pipeline(transaction=False)
        streams = [(model, p) for model in names
                   for p in range(1, models[model].queue.priority_levels + 1)]
        for model, priority in streams:
            pipe.xlen(keys.queue(model, priority))
        for model in names:
            pipe.hgetall(keys.stats(model))
        try:
            results = await pipe.execute()
        except REDIS_FAILED:
            return
        self._shared.depth = {(model, str(p)): int(n)
                              for (model, p), n in zip(streams, results, strict=False)}
        self._shared.totals = {
            model: {k.decode(): int(v) for k, v in raw.items()}
            for model, raw in zip(names, results[len(streams):], strict=True)}
