"""The API's Prometheus metrics (names fixed by DESIGN section 9)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                   5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "conveyor_requests_total", "Inference requests answered, by outcome",
            ["model", "outcome"], registry=self.registry)
        self.duration = Histogram(
            "conveyor_request_duration_seconds", "Time from request received to answer sent",
            ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram(
            "conveyor_queue_duration_seconds", "Time a request waited in its stream before "
            "its batch started", ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_size = Histogram(
            "conveyor_batch_size", "Rows in the batch each request ran in",
            ["model"], buckets=BATCH_BUCKETS, registry=self.registry)
