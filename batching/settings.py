"""Process settings from the environment (prefix ``CONVEYOR_``), one typed object passed in."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    """One server (``redis://``, ``rediss://``, ``unix://``), a Sentinel-watched primary
    (``redis+sentinel://h1:26379,h2:26379/mymaster/0``) or a Cluster
    (``redis+cluster://h1:7000,h2:7001``): batching.redis_topology."""
    celery_broker_url: str = ""
    """Celery's broker and result backend; empty: ``redis_url``. A plain or Sentinel URL;
    Celery cannot use a Redis Cluster, so a cluster ``redis_url`` needs this set."""
    model_repository: Path = Path("./models")
    key_prefix: str = "cv"
    models: str = ""
    """Comma-separated model names to serve; empty serves every model in the repository."""
    heartbeat_interval_s: float = 1.0
    heartbeat_stale_s: float = 5.0
    """A worker heartbeat older than this no longer counts for readiness."""
    http_port: int = 8000
    grpc_port: int = 8001
    flower_port: int = 5555
    worker_port: int = 8002
    """The inference worker's probe port (/live, /ready); 0 turns the probe off."""
    api_workers: int = Field(default=0, ge=0, le=256)
    """API processes sharing the HTTP and gRPC ports (``python -m api.serve``, ``conveyor
    run``); 0: half the cores available to the process, at least one (the other half is
    for the inference processes and Redis on the same host)."""
    reserved_cores: int = Field(default=1, ge=0, le=4096)
    """Cores an inference worker leaves to the processes beside its models (on one host: the
    API, Redis, the worker's own Celery process) when it derives a CPU model's intra-op
    threads (``cpu_threads.intra_op`` unset); 0 on a host that runs the model alone.
    Measured on two cores shared with the API: the same capacity, and under bursts past it
    two to four times the answers in time with a core left (docs/batching.md)."""
    lone_all_cores: bool = True
    """A lone request (the only one its API process has in flight) runs on every core the
    inference process may use, reserved ones included, when that measured faster: at that
    load the API waits idle for it. For an onnx model this is a second onnxruntime session,
    with its own copy of the weights; false runs every batch with the reserved cores left
    out."""
    batch_events_per_s: int = 100
    """Most Celery task events (three per executed batch, for Flower) an inference process
    sends a second; more batches are merged into fewer tasks. 0 sends none."""
    busy_poll_us: int = 1000
    """How long a process polls, yielding its CPU to anything runnable, before it sleeps,
    around a lone request (the only one its API process has in flight): the API while it
    awaits the reply, an inference process after running it. A sleeping virtual CPU
    wakes slowly and with cold caches (docs/data-path.md section 7); 0 turns it off."""
    lean_redis: bool = True
    """The per-request Redis commands (admission and reply pops in the API, an inference
    process's reads and answers) use conveyor's lean RESP client; false puts them on
    redis-py, at several times the CPU per command (docs/data-path.md section 7)."""
    job_result_ttl_s: int = 86_400
    """How long a finished job's state and result stay readable."""
    job_max_bytes: int = 64 * 1024 * 1024
    """Largest ``POST /v1/jobs`` body (JSON or binary tensors); larger is a 413."""
    job_chunk_rows: int = 0
    """Rows per chunk a job feeds into the model's streams; 0: the model's max_batch_size
    (never more)."""
    job_max_in_flight: int = 0
    """Chunks of one job admitted and not yet answered, at most; 0: one more than the
    model's ready instances (at least 2)."""
    job_chunk_timeout_s: float = 600.0
    """A chunk's deadline; a chunk answered with a deadline error, or not at all, is re-sent."""
    job_lease_s: float = 10.0
    """Lease of a running job, renewed every third of it; a job whose lease lapses (its
    worker died) is resumed from its finished chunks by another job worker."""

    # --- Limits (Triton's defaults where Triton has one) ---------------------------------
    max_request_bytes: int = 64 * 1024 * 1024
    """Largest request after decompression, HTTP (413) and gRPC (RESOURCE_EXHAUSTED); it
    also bounds gRPC messages received and sent."""
    large_body_bytes: int = 1024 * 1024
    """A request body at least this large counts as large (see ``max_large_bodies``)."""
    max_large_bodies: int = 2
    """Large bodies read or inflated at once in one API process (infer and jobs); more
    wait their turn."""
    http_keepalive_s: float = 5.0
    """An idle keep-alive HTTP connection is closed after this long."""
    http_header_timeout_s: float = 10.0
    """A connection must send a request's complete headers within this long."""
    http_body_timeout_s: float = 30.0
    """A request body must arrive within this long (408 otherwise)."""
    http_max_connections: int = 2048
    """Open HTTP connections one API process accepts; more are closed at once."""

    # --- Listeners ------------------------------------------------------------------------
    host: str = "127.0.0.1"
    """Address every listener binds (HTTP, gRPC, worker probe, Flower under ``conveyor
    run``). Anything but loopback without ``api_keys_file`` needs ``allow_unauthenticated``."""
    grpc_server: Literal["native", "grpcio"] = "native"
    """What serves the gRPC port: ``native``, conveyor's own HTTP/2 in the API's event loop
    (docs/data-path.md), or ``grpcio``, grpc.aio's server. Same methods, statuses and
    limits; native costs a fraction of the CPU per call."""
    grpc_reuseport: bool = False
    """Let several API processes share the gRPC port (SO_REUSEPORT). Off: a port taken by
    another program is an error at start."""
    tls_cert_file: Path | None = None
    """PEM certificate chain: HTTP and gRPC then speak TLS only."""
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    """When set, clients must present a certificate signed by this CA (mutual TLS)."""

    # --- Authentication and control -------------------------------------------------------
    api_keys_file: Path | None = None
    """One key per line: ``<key> <scope>[,<scope>...]``, scopes infer, jobs, admin. Re-read
    when it changes. Unset: no authentication (listeners on loopback only)."""
    auth_health: bool = False
    """Health endpoints need a key too (any scope)."""
    auth_metrics: bool = False
    """``/metrics`` and ``/v2/conveyor/queues`` need a key too (any scope)."""
    allow_unauthenticated: bool = False
    """Allow binding beyond loopback with no ``api_keys_file``."""
    model_control: Literal["none", "explicit"] = "none"
    """Repository load/unload over HTTP and gRPC: ``none`` refuses them (Triton's
    ``--model-control-mode``); ``explicit`` allows them to ``admin`` keys."""
    allow_client_shm: bool = False
    """Clients on this host may register system shared memory regions and pass tensors
    through them (Triton's ``--allow-client-shm``; needs the ``infer`` scope). Off,
    register and unregister answer 501 / UNIMPLEMENTED."""
    shm_max_regions: int = 64
    """Registered system shared memory regions, at most, for all the API processes of a
    host together."""
    tensor_arena_mb: int = Field(default=64, ge=0, le=65536)
    """Each API process's shared-memory arena for large inputs (MiB, in ``/dev/shm``,
    reserved on first use): an input of ``tensor_arena_min_bytes`` or more travels
    through it instead of through Redis while every inference process of its model shares
    the API process's memory (same host, same ``/dev/shm``). 0: every input through Redis."""
    tensor_arena_min_bytes: int = Field(default=32768, ge=1)
    """The smallest input that goes through the tensor arena or the bytes endpoint."""
    tensor_transport: Literal["auto", "fetch", "redis"] = "auto"
    """How an input of ``tensor_arena_min_bytes`` or more reaches the inference processes:
    ``auto``, through the tensor arena where they all share the API process's memory,
    else (or when the arena is full) fetched by them from the API process's bytes
    endpoint (docs/data-path.md);
    ``fetch``, from the endpoint always (the path between hosts, on one host); ``redis``,
    in the stream entry always."""
    tensor_fetch_port: int = Field(default=0, ge=0, le=65535)
    """The API process's bytes endpoint listens on ``host`` at the first free port from
    this one (one per API process); 0: any free port."""
    tensor_fetch_host: str = ""
    """The address inference processes reach this API process's bytes endpoint at; empty:
    ``host``, or where ``host`` names every interface, this host's address on the way to
    Redis."""
    tensor_fetch_timeout_s: float = Field(default=2.0, gt=0)
    """How long an inference process waits for the inputs it fetches from API processes;
    a request whose inputs did not come is answered with an error (503)."""
    tensor_fetch_ca_file: Path | None = None
    """The CA an inference process checks a bytes endpoint that speaks TLS against (the
    API's ``tls_cert_file`` is signed by it); unset: the system's CAs."""
    server_name: Annotated[str, Field(min_length=1)] = "conveyor"
    """The server's ``name`` in its metadata (``GET /v2``, gRPC ``ServerMetadata``)."""
    callback_hosts: str = ""
    """Comma-separated host names or addresses job ``callback_url`` may name; loopback,
    link-local and private addresses are refused unless listed. Empty: no callbacks."""

    def celery_broker(self) -> str:
        """The URL Celery's broker and result backend are on."""
        return self.celery_broker_url or self.redis_url

    def model_filter(self) -> set[str]:
        return {m.strip() for m in self.models.split(",") if m.strip()}

    def api_processes(self) -> int:
        """``api_workers``, or when it is 0 half the cores this process may run on (at
        least one)."""
        return self.api_workers or max(1, len(os.sched_getaffinity(0)) // 2)
