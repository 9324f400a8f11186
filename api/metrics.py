"""The API's Prometheus metrics (api/metric_defs.py names each one; docs/metrics.md lists them).

Most are counted by this process as it answers. With ``PROMETHEUS_MULTIPROC_DIR`` set
(prometheus_client's multiprocess mode, for ``uvicorn --workers N``), every process
writes its counts there and a scrape of any of them reports the sum over all. The rest
describe state shared by every process: read from Redis when ``/metrics`` is scraped
(:meth:`ApiMetrics.refresh`, api/metrics_shared.py) and from the workers' heartbeats.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from redis.asyncio import Redis

from api import body_timeouts
from api import metric_defs as d
from api.metric_defs import MetricDef
from api.metrics_shared import SharedState
from batching.config import ModelConfig
from batching.errors import Overloaded, from_code
from batching.histograms import BATCH_BUCKETS, LATENCY_BUCKETS
from batching.keys import Keys
from batching.process_memory import resident_bytes

PROTOCOLS = ("http_json", "http_binary", "grpc", "grpc_stream")
"""Values of the ``protocol`` label: how an inference request reached the API."""


def http_code(outcome: str) -> str:
    """The HTTP status (as text) of a request's outcome: ``success`` or an error code."""
    return "200" if outcome == "success" else str(from_code(outcome, "").http_status)


class _Merged(Collector):
    """The families of several collectors, those of one name joined into one: the API's
    resident memory is counted here, the workers' comes from heartbeats, under one name."""

    def __init__(self, *collectors: Collector) -> None:
        self._collectors = collectors

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for collector in self._collectors:
            for family in collector.collect():
                known = families.setdefault(family.name, family)
                if known is not family:
                    known.samples.extend(family.samples)
        yield from families.values()


@dataclass(slots=True)
class ModelSeries:
    """One model's labelled children, looked up once: ``.labels()`` per request costs
    more than the observation itself."""

    model: str
    queue: Any
    batch_size: Any
    in_flight: Any
    metrics: ApiMetrics
    outcomes: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def outcome(self, outcome: str) -> tuple[Any, Any]:
        """The children counting requests and timing them, for ``outcome``."""
        children = self.outcomes.get(outcome)
        if children is None:
            children = self.outcomes[outcome] = (
                self.metrics.requests.labels(self.model, outcome),
                self.metrics.duration.labels(self.model, outcome, http_code(outcome)))
        return children


def _args(metric: MetricDef) -> dict[str, Any]:
    return {"name": metric.base, "documentation": metric.help, "labelnames": metric.labels}


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(**_args(d.REQUESTS), registry=reg)
        self.protocol_requests = Counter(**_args(d.PROTOCOL_REQUESTS), registry=reg)
        reg.register(body_timeouts.counter())  # counted by the listeners, one per process
        self.duration = Histogram(**_args(d.REQUEST_DURATION), buckets=LATENCY_BUCKETS,
                                  registry=reg)
        self.queue = Histogram(**_args(d.QUEUE_DURATION), buckets=LATENCY_BUCKETS, registry=reg)
        self.batch_size = Histogram(**_args(d.REQUEST_BATCH_SIZE), buckets=BATCH_BUCKETS,
                                    registry=reg)
        self.in_flight = Gauge(**_args(d.IN_FLIGHT), multiprocess_mode="livesum", registry=reg)
        self.memory = Gauge(**_args(d.RESIDENT_MEMORY), multiprocess_mode="livesum",
                            registry=reg).labels("api", "", "")
        self.loop_lag = Gauge(**_args(d.LOOP_LAG), multiprocess_mode="livemax", registry=reg)
        self._protocols = {p: self.protocol_requests.labels(p) for p in PROTOCOLS}
        self._series: dict[str, ModelSeries] = {}
        self._shared = SharedState()
        self.sample_memory()

    def exposition(self) -> bytes:
        """The text a scrape gets: this process's counts, or every process's in
        multiprocess mode, then the shared state last read from Redis."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        own: Collector = self.registry
        if directory:
            own = CollectorRegistry()
            MultiProcessCollector(own, directory)  # type: ignore[no-untyped-call]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged(own, self._shared))
        return generate_latest(registry)

    def sample_memory(self) -> None:
        """Record this process's resident memory (each process, every heartbeat interval)."""
        rss = resident_bytes()
        if rss is not None:
            self.memory.set(rss)

    def protocol(self, protocol: str) -> Any:
        return self._protocols.get(protocol) or self.protocol_requests.labels(protocol)

    def of(self, model: str) -> ModelSeries:
        series = self._series.get(model)
        if series is None:
            series = self._series[model] = ModelSeries(
                model, self.queue.labels(model), self.batch_size.labels(model),
                self.in_flight.labels(model), self)
        return series

    def refused(self, model: str, seconds: float) -> None:
        """A request refused by the HTTP listener before it reached the service (its unread
        wait, api/overload.py ``refuses_unread``): counted with the API's other 503s."""
        requests, duration = self.of(model).outcome(Overloaded.code)
        requests.inc()
        duration.observe(seconds)

    def set_model_states(self, states: Mapping[str, str]) -> None:
        """Every model folder's repository state, as the index reports it."""
        self._shared.model_states = dict(states)

    async def refresh(self, redis: Redis, keys: Keys, models: Mapping[str, ModelConfig],
                      beats: Mapping[str, list[dict[str, Any]]]) -> None:
        """Read the shared state from Redis (one round trip); keep the last on failure.

        ``beats``: each model's fresh heartbeats, as the API's worker watch last read them.
        """
        self.sample_memory()
        await self._shared.refresh(redis, keys, models, beats)
