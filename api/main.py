"""The API application, built by :func:`create_app`: ``python -m api.serve`` (HTTP on
``CONVEYOR_HTTP_PORT``, 8000) or ``uvicorn --factory api.main:create_app``, with gRPC on
``settings.grpc_port`` (8001) served from the same event loop.

Importing this module builds nothing (no settings read, no repository scan, no Redis
client) and loads no gRPC module (``api.proto``, only when ``create_app`` serves gRPC), so
tests build the application in-process with their own settings and dispatcher
(tests/unit).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from api.auth import Guard, KeyStore
from api.auth_http import AuthGuard
from api.body import BodyLimits
from api.bytes_endpoint import endpoint_from
from api.dispatch import Dispatcher
from api.dispatch_port import DispatchPort
from api.ensemble import Ensembles
from api.health import WorkerWatch
from api.infer import ASGIApp, InferRoute
from api.input_arena import InputArena
from api.job_routes import jobs_router
from api.metrics import ApiMetrics
from api.output_offers import offers_from
from api.periodic import Periodic
from api.queue_routes import queues_router
from api.repository_control import Repository
from api.routes import VERSION, add_routes
from api.service import InferenceService
from api.shared_memory import SharedMemory
from api.shm_routes import add_shm_routes
from batching.keys import Keys
from batching.repository_scan import scan_repository
from batching.settings import Settings

if TYPE_CHECKING:
    from api.grpc_native import NativeGrpcEndpoint
    from api.grpc_server import GrpcEndpoint

log = logging.getLogger("conveyor.api")


GC_THRESHOLDS = (20_000, 50, 100)
"""The cyclic collector runs after 20,000 net allocations instead of 700: with dozens of
requests in flight, the default re-scanned their live objects every few requests
(API CPU per request -5% at c=64, docs/data-path.md section 7). Cycles still go; they wait
a little longer."""

DOCS_ASSETS = "/docs/assets"
"""Where the Swagger UI and ReDoc scripts are served from (package fastapi-offline), so
``/docs`` and ``/redoc`` render without reaching a CDN."""


def create_app(settings: Settings | None = None, dispatcher: DispatchPort | None = None,
               *, grpc: bool = True) -> ASGIApp:
    """The API as one ASGI application: ``AuthGuard(InferRoute(FastAPI app))``.

    ``settings`` default to the environment's and ``dispatcher`` to Redis at
    ``settings.redis_url``; ``grpc=False`` leaves the gRPC listener out (and unimported),
    for tests that serve HTTP only.
    """
    settings = settings or Settings()
    keys = Keys(settings.key_prefix)
    scan = scan_repository(settings.model_repository, settings.model_filter() or None)
    models = scan.models
    if dispatcher is None:
        dispatcher = Dispatcher(settings.redis_url, keys, settings.busy_poll_us / 1e6,
                                lean=settings.lean_redis)
    watch = WorkerWatch(dispatcher, keys, models, settings.heartbeat_interval_s,
                        settings.heartbeat_stale_s, broken=scan.failed)
    shm = SharedMemory(dispatcher, keys, enabled=settings.allow_client_shm,
                       max_regions=settings.shm_max_regions,
                       max_bytes=settings.max_request_bytes,
                       interval_s=settings.heartbeat_interval_s)
    endpoint = endpoint_from(settings)
    if isinstance(dispatcher, Dispatcher):
        dispatcher.outputs = offers_from(settings, endpoint, models, watch.shares_memory)
    arena = InputArena(settings.tensor_arena_mb << 20, settings.tensor_arena_min_bytes,
                       watch.shares_memory, endpoint=endpoint, models=models,
                       transport=settings.tensor_transport)
    service = InferenceService(models, dispatcher, watch, keys, ApiMetrics(),
                               BodyLimits.from_settings(settings), broken=scan.failed, shm=shm,
                               arena=arena, ensembles=Ensembles(scan.ensembles))
    repository = Repository(settings.model_repository, settings.model_filter() or None, models,
                            service.unloaded, dispatcher, watch, keys, settings.heartbeat_interval_s,
                            failed=scan.failed, control=settings.model_control == "explicit",
                            ensembles=service.ensembles)
    guard = Guard(KeyStore(settings.api_keys_file), settings.auth_health, settings.auth_metrics)

    async def sample_process() -> None:
        service.metrics.sample_memory()
        service.metrics.loop_lag.set(service.overload.lag_s)

    memory = Periodic("conveyor-process-sample", settings.heartbeat_interval_s, sample_process)
    grpc_endpoint = grpc_server(service, repository, settings, guard) if grpc else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await dispatcher.start()
        await repository.start()
        await watch.start()
        await shm.start()
        if endpoint is not None:
            endpoint.start()
        memory.start()
        service.overload.start(service.metrics.refused)
        if grpc_endpoint is not None:
            await grpc_endpoint.start()
        log.info("conveyor API serving %s from %s", sorted(models), settings.model_repository)
        gc.collect()
        gc.freeze()  # start-up objects never need scanning again (p99, docs/data-path.md section 7)
        gc.set_threshold(*GC_THRESHOLDS)
        yield
        if grpc_endpoint is not None:
            await grpc_endpoint.close()
        await repository.close()
        await memory.close()
        await service.overload.close()
        await shm.close()
        arena.close()
        if endpoint is not None:
            endpoint.close()
        await watch.close()
        await dispatcher.close()

    app: FastAPI = FastAPIOffline(title="conveyor", version=VERSION, lifespan=lifespan,
                                  static_url=DOCS_ASSETS)
    add_routes(app, service, repository, settings.server_name)
    add_shm_routes(app, shm)
    app.include_router(jobs_router(service, settings))
    app.include_router(queues_router(service))
    return AuthGuard(InferRoute(app, service), guard)


def grpc_server(service: InferenceService, repository: Repository, settings: Settings,
                guard: Guard) -> GrpcEndpoint | NativeGrpcEndpoint:
    """The gRPC endpoint (``settings.grpc_server``), imported only here: its generated
    ``api.proto`` module is loaded by the processes that serve gRPC, never by those that
    only build the HTTP app."""
    if settings.grpc_server == "native":
        from api.grpc_native import NativeGrpcEndpoint

        return NativeGrpcEndpoint(service, repository, settings, guard)
    from api.auth_grpc import AuthInterceptor
    from api.grpc_decode import DecodeGuard
    from api.grpc_server import GrpcEndpoint

    return GrpcEndpoint(service, repository, settings, [AuthInterceptor(guard), DecodeGuard()])
