"""Every metric ``/metrics`` exports: name, type, labels, help text and documented meaning.

The one table both the code and the documentation use: api/metrics.py and
api/metrics_shared.py create their metrics from it, and ``python -m api.metrics_doc``
writes the tables of docs/metrics.md from it (a test checks the two agree, and that a
scrape exports nothing this table lacks).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

SECTIONS = ("api", "redis", "states", "heartbeats")
"""Where each metric is listed in docs/metrics.md: counted by the API process, read from
Redis when scraped, repository states, from worker heartbeats."""


@dataclass(frozen=True, slots=True)
class MetricDef:
    name: str
    """As exposed (a counter's with ``_total``)."""
    kind: str
    """counter, gauge or histogram."""
    labels: tuple[str, ...]
    help: str
    """The exposition's HELP line."""
    doc: str
    """Its meaning in docs/metrics.md (Markdown, one paragraph)."""
    section: str

    @property
    def base(self) -> str:
        """The name prometheus_client takes (without ``_total``)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name

    def family(self) -> CounterMetricFamily | GaugeMetricFamily:
        """An empty family of this counter or gauge, for a collector to fill."""
        if self.kind == "counter":
            return CounterMetricFamily(self.base, self.help, labels=list(self.labels))
        assert self.kind == "gauge", self.name
        return GaugeMetricFamily(self.name, self.help, labels=list(self.labels))

    def histogram(self) -> HistogramMetricFamily:
        """An empty family of this histogram, for a collector to fill."""
        assert self.kind == "histogram", self.name
        return HistogramMetricFamily(self.name, self.help, labels=list(self.labels))


# Counted by each API process.
REQUESTS = MetricDef(
    "conveyor_requests_total", "counter", ("model", "outcome"),
    "Inference requests answered, by outcome",
    "Inference requests answered, over any protocol. `outcome` is `success` or an error "
    "code: `invalid_input`, `not_found`, `overloaded`, `unavailable`, `deadline_exceeded`, "
    "`model_failure` or `internal` (any code of [api.md](api.md#errors)). Requests for "
    "unknown or unloaded models, or unknown versions, count under `model=\"_unknown\"`.",
    "api")
PROTOCOL_REQUESTS = MetricDef(
    "conveyor_protocol_requests_total", "counter", ("protocol",),
    "Inference requests received, by protocol (http_json, http_binary, grpc, grpc_stream)",
    "Inference requests received, by how they came. `http_json`: HTTP without "
    "`Inference-Header-Content-Length`. `http_binary`: HTTP with it, including raw requests. "
    "`grpc`: `ModelInfer`. `grpc_stream`: each request on a `ModelStreamInfer` stream. All "
    "four are exported from start-up, at 0.",
    "api")
BODY_TIMEOUTS = MetricDef(
    "conveyor_body_timeouts_total", "counter", ("listener",),
    "Requests whose body did not arrive within CONVEYOR_HTTP_BODY_TIMEOUT_S, by listener",
    "Requests cut off by the listener because their body did not arrive in time "
    "(`CONVEYOR_HTTP_BODY_TIMEOUT_S`, [security.md](security.md)). `listener=\"http\"`: an "
    "HTTP/1.1 body not complete within the timeout of its headers, answered 408 and its "
    "connection closed. `listener=\"grpc\"`: a message on an HTTP/2 stream of the native gRPC "
    "listener not complete within the timeout of its first byte, the stream reset "
    "(`CANCEL`). Both are exported from start-up, at 0.",
    "api")
REQUEST_DURATION = MetricDef(
    "conveyor_request_duration_seconds", "histogram", ("model", "outcome", "code"),
    "Time from request received to answer sent, by outcome and HTTP status",
    "From receiving the request to having its answer, for every outcome. `outcome` is that "
    "of `conveyor_requests_total`; `code` the HTTP status of the answer as text (`200`, "
    "`400`, `503`...), for gRPC requests too: the HTTP status of the same error in the "
    "error table of [api.md](api.md#errors). Select `code=\"200\"` for the latency of answered "
    "requests: fast rejections would drag the percentiles down.",
    "api")
QUEUE_DURATION = MetricDef(
    "conveyor_queue_duration_seconds", "histogram", ("model",),
    "Time a request waited in its stream before its batch started",
    "Successful requests only: from enqueueing in the API to the start of the batch in the "
    "worker. The two clocks are on different hosts, so this assumes they are synchronised.",
    "api")
REQUEST_BATCH_SIZE = MetricDef(
    "conveyor_request_batch_size", "histogram", ("model",),
    "Rows in the batch each request ran in (observed once per request)",
    "Successful requests only: the rows in the batch each request ran in, observed once per "
    "request (a batch of 8 requests counts 8 times). The batches themselves are "
    "`conveyor_batch_size`.",
    "api")
IN_FLIGHT = MetricDef(
    "conveyor_requests_in_flight", "gauge", ("model",),
    "Inference requests received and not yet answered",
    "Inference requests of a known model that the API has received and not yet answered: "
    "waiting in the queue, running, or being encoded. Summed over the processes of one "
    "container (multiprocess mode `livesum`).",
    "api")
LOOP_LAG = MetricDef(
    "conveyor_api_event_loop_lag_seconds", "gauge", (),
    "How late the API's event loop runs a timer, smoothed (the worst API process)",
    "How late each API process's event loop runs a 5 ms timer, smoothed over about 50 ms, "
    "sampled every `CONVEYOR_HEARTBEAT_INTERVAL_S`; the worst process of the container "
    "(multiprocess mode `livemax`). A millisecond or two while the API keeps up; 0 while no "
    "request has come for 100 ms (the timer stops until the next one). A request "
    "waits about twice this long before the API reads it, and one that could no longer be "
    "answered within its timeout is refused at once with 503 (code `overloaded`, "
    "docs/operations.md).",
    "api")

# Read from Redis at scrape time.
REDIS_UP = MetricDef(
    "conveyor_redis_up", "gauge", (),
    "Whether this scrape read Redis (1) or it did not answer (0)",
    "1 when this scrape's Redis reads succeeded, 0 when Redis did not answer (the other "
    "metrics read from Redis then keep their last values). Alert on it staying 0.",
    "redis")
QUEUE_DEPTH = MetricDef(
    "conveyor_queue_depth", "gauge", ("model", "priority"),
    "Entries in a model's request stream of one priority (waiting or being executed), read "
    "from Redis at scrape time",
    "`XLEN` of the model's request stream of that priority (1 = highest). It counts the "
    "entries waiting plus those a worker has read but not yet answered: workers delete "
    "entries once they answer them. There is one series per priority level of every loaded "
    "model.",
    "redis")
QUEUE_OLDEST_AGE = MetricDef(
    "conveyor_queue_oldest_age_seconds", "gauge", ("model", "priority"),
    "Age of the oldest entry no worker has read yet, per model stream and priority",
    "How long the oldest entry that no worker has read yet has been waiting in the stream "
    "of that priority (from its stream ID, a Redis timestamp, to Redis's clock now); 0 when "
    "every entry has been delivered. It grows while no worker reads the stream, whatever "
    "the queue's depth.",
    "redis")
QUEUE_DRAIN = MetricDef(
    "conveyor_queue_drain_seconds", "gauge", ("model",),
    "Seconds the queue would take to drain at the measured service rate (+Inf: nothing serves)",
    "Rows admitted and not yet answered (the queue limit's count, `cv:{m}:rows`) divided by "
    "the rows per second the model's ready inference processes serve together (each one's "
    "rows per second of batch execution over its last batches, from its heartbeat). 0 when "
    "no row waits; `+Inf` when rows wait and no ready process has run a batch yet (none "
    "serves): an alert such as `conveyor_queue_drain_seconds > 60` fires on both a slow "
    "queue and a stuck one.",
    "redis")
ROWS = MetricDef(
    "conveyor_rows_total", "counter", ("model",),
    "Rows executed by the model (inference_count)",
    "Rows the model executed (Triton's `inference_count`), in batches that succeeded or "
    "failed, for requests and job chunks alike; `rate()` gives rows per second.",
    "redis")
BATCH_SIZE = MetricDef(
    "conveyor_batch_size", "histogram", ("model",),
    "Rows per executed batch (observed once per batch)",
    "Rows of each executed batch, observed once per batch (from the workers' per-size batch "
    "counts, `batch:{rows}:count`). `_count` is the number of batches, `_sum` the rows.",
    "redis")
BATCH_EXECUTION = MetricDef(
    "conveyor_batch_execution_seconds", "histogram", ("model",),
    "Time the model took per executed batch",
    "Time of each executed batch: stacking its inputs, the model call, splitting the "
    "outputs and any out-of-memory retries. `_count` is the number of batches.",
    "redis")
BATCHES = MetricDef(
    "conveyor_batches_total", "counter", ("model", "reason"),
    "Executed batches by why they were dispatched (full, window, deadline, policy, drain)",
    "Executed batches by why they were dispatched: `full`, `window`, `deadline`, `policy` "
    "(adaptive only) or `drain` (what a stopping process still held). A reason appears once "
    "it has occurred. With `max_queue_delay_us: 0`, batches that go at once count as "
    "`window`.",
    "redis")
BATCH_WAIT = MetricDef(
    "conveyor_batch_wait_seconds_total", "counter", ("model",),
    "Time batches waited between the first entry read and dispatch, summed",
    "Summed over executed batches: the time from when the process read (or claimed) the "
    "batch's oldest entry to the batch's start. Divide by "
    "`conveyor_batch_execution_seconds_count` for the mean wait.",
    "redis")
OOM = MetricDef(
    "conveyor_oom_total", "counter", ("model",),
    "Batches that ran out of device memory (then split)",
    "Model calls that ran out of device memory (`oom_count`): each one, including those of "
    "the halves retried while a batch is split.",
    "redis")
RECLAIMED = MetricDef(
    "conveyor_reclaimed_total", "counter", ("model",),
    "Entries reclaimed from a dead consumer and delivered again",
    "Entries claimed from a dead or stuck consumer (`reclaimed_count`), including those "
    "then dead-lettered.",
    "redis")
DEAD_LETTER = MetricDef(
    "conveyor_dead_letter_total", "counter", ("model",),
    "Requests moved to the dead-letter stream past the delivery limit",
    "Requests moved to the model's dead-letter stream after more than `max_deliveries` "
    "deliveries (`dead_letter_count`).",
    "redis")
WITHDRAWN = MetricDef(
    "conveyor_withdrawn_total", "counter", ("model",),
    "Requests withdrawn unrun because their client left before the answer",
    "Requests whose HTTP client disconnected or whose gRPC call was cancelled before the "
    "model ran them (`withdrawn_count`): deleted from the stream if no worker had read them, "
    "else dropped by the worker without running "
    "([batching.md](batching.md#requests-whose-client-left)).",
    "redis")
SHED = MetricDef(
    "conveyor_shed_total", "counter", ("model",),
    "Requests answered at once because a batch could not finish in time",
    "Requests the adaptive policy answered without running them, past capacity: `504` when "
    "a batch started then could not have finished before their deadline, `503` "
    "(`overloaded`) when, with `batching.overload: lifo`, it could not have finished within "
    "the model's `latency_target_ms` (`shed_count`; "
    "[batching.md](batching.md#past-capacity-newest-first-and-refused-at-once)).",
    "redis")
RESTARTS = MetricDef(
    "conveyor_worker_restarts_total", "counter", ("model",),
    "Inference processes replaced after they died, hung or failed to load",
    "Inference processes the supervisors replaced after they exited: crashed, killed as "
    "hung (`execution_timeout_s`, stopped heartbeat), lost their device, or failed to load "
    "(`restart_count`). Stops and unloads are not counted.",
    "redis")
JOB_ROWS = MetricDef(
    "conveyor_job_rows_total", "counter", ("model",),
    "Rows of async jobs processed",
    "Rows of async jobs whose chunk the model answered and the job stored (`job_rows`); "
    "`rate()` gives job rows per second.",
    "redis")
JOBS = MetricDef(
    "conveyor_jobs", "gauge", ("state",),
    "Async jobs waiting to start (PENDING) or running (RUNNING)",
    "Async jobs in each unfinished state now: `PENDING` (accepted, not started) and "
    "`RUNNING`. Kept up to date by each state change; job workers also recount them "
    "every `CONVEYOR_JOB_LEASE_S`/2, which takes off a job whose record expired before it "
    "ran.",
    "redis")
JOBS_FINISHED = MetricDef(
    "conveyor_jobs_finished_total", "counter", ("state",),
    "Async jobs that ended, by final state (SUCCEEDED, FAILED, CANCELLED)",
    "Async jobs that ended, by their final state: `SUCCEEDED`, `FAILED` or `CANCELLED`. "
    "A job's record is kept `CONVEYOR_JOB_RESULT_TTL_S` after it ends; this count is not "
    "lowered when it expires.",
    "redis")

# Repository states.
MODEL_STATE = MetricDef(
    "conveyor_model_state", "gauge", ("model", "state"),
    "Each model folder's repository state (READY, LOADING, UNAVAILABLE): 1 for the state it "
    "is in",
    "Each model folder's state in the repository index (`POST /v2/repository/index`): one "
    "series per folder and each of `READY`, `LOADING`, `UNAVAILABLE`, valued 1 for the "
    "state the model is in and 0 for the others. A model whose `config.yaml` does not "
    "parse, whose worker reported it failed to load, or that is unloaded is `UNAVAILABLE`; "
    "the index gives the reason.",
    "states")

# From worker heartbeats.
INSTANCE_STATE = MetricDef(
    "conveyor_model_instance_state", "gauge", ("model", "consumer", "state"),
    "Each inference process's state (ready, loading, failed): 1 for the state it is in",
    "One series per inference process (or slot of one, while no process of it beats) and "
    "each of `ready`, `loading`, `failed`, valued 1 for the state it is in. `loading` "
    "includes a slot whose process is being replaced; `failed` is a slot whose model "
    "failed to load (retried slowly).",
    "heartbeats")
ROW_CAP = MetricDef(
    "conveyor_row_cap", "gauge", ("model", "consumer"),
    "Learned row cap of an inference process (out of memory halves it, full batches probe it "
    "back up)",
    "The inference process's learned row cap: at most `max_batch_size` (or its run-time "
    "override); an out-of-memory error lowers it, and full batches probe it back up.",
    "heartbeats")
ARRIVAL_RATE = MetricDef(
    "conveyor_policy_arrival_rate_rows_per_second", "gauge", ("model", "consumer"),
    "Arrival rate (rows/s) the batching policy estimates",
    "Arrival rate in rows per second, as the adaptive policy estimates it.",
    "heartbeats")
LATENCY_INTERCEPT = MetricDef(
    "conveyor_policy_latency_intercept_seconds", "gauge", ("model", "consumer"),
    "Fixed cost a of the policy's batch latency model t(n) = a + b*n",
    "`a` in the adaptive policy's batch latency model `t(n) = a + b·n`.",
    "heartbeats")
LATENCY_SLOPE = MetricDef(
    "conveyor_policy_latency_slope_seconds", "gauge", ("model", "consumer"),
    "Per-row cost b of the policy's batch latency model t(n) = a + b*n",
    "`b` in the same model: seconds per row.",
    "heartbeats")
SHED_RESERVE = MetricDef(
    "conveyor_policy_shed_reserve_seconds", "gauge", ("model", "consumer"),
    "Time the adaptive policy keeps, when it sheds, for the path outside the inference process",
    "Past capacity the adaptive policy answers at once the requests that a batch started now "
    "would not answer in time: a batch of `n` rows is answered `t(n)` plus this from now. It "
    "is what the requests' API processes report that they spend outside the inference process "
    "(mean plus two mean deviations, at least 5% of `latency_target_ms`), or 30% of the target "
    "until one has reported.",
    "heartbeats")
GPU_USED = MetricDef(
    "conveyor_gpu_memory_used_bytes", "gauge", ("host", "device"),
    "GPU memory in use",
    "Memory in use on a CUDA device (all processes on it, from `torch.cuda.mem_get_info`).",
    "heartbeats")
GPU_TOTAL = MetricDef(
    "conveyor_gpu_memory_total_bytes", "gauge", ("host", "device"),
    "GPU memory in all",
    "Total memory of that device.",
    "heartbeats")
RESIDENT_MEMORY = MetricDef(
    "conveyor_process_resident_memory_bytes", "gauge", ("role", "model", "consumer"),
    "Resident memory of API processes (role=api) and inference processes (role=worker)",
    "Resident set size (Linux `/proc/self/statm`). `role=\"api\"`: the API processes of the "
    "scraped container together (multiprocess mode `livesum`; `model` and `consumer` "
    "empty), sampled every `CONVEYOR_HEARTBEAT_INTERVAL_S`. `role=\"worker\"`: one series per "
    "inference process, from its heartbeat, the same on every API process.",
    "heartbeats")

ALL = (REDIS_UP, REQUESTS, PROTOCOL_REQUESTS, BODY_TIMEOUTS, REQUEST_DURATION, QUEUE_DURATION,
       REQUEST_BATCH_SIZE, IN_FLIGHT, LOOP_LAG, QUEUE_DEPTH, QUEUE_OLDEST_AGE, QUEUE_DRAIN, ROWS,
       BATCH_SIZE, BATCH_EXECUTION, BATCHES, BATCH_WAIT, OOM, RECLAIMED, DEAD_LETTER, WITHDRAWN,
       SHED, RESTARTS, JOB_ROWS, JOBS, JOBS_FINISHED, MODEL_STATE, INSTANCE_STATE, ROW_CAP,
       ARRIVAL_RATE, LATENCY_INTERCEPT, LATENCY_SLOPE, SHED_RESERVE, GPU_USED, GPU_TOTAL,
       RESIDENT_MEMORY)
