"""The API process: ``uvicorn api.main:app`` (HTTP, port 8000 by convention), and gRPC on
``settings.grpc_port`` (8001) served from the same event loop."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.auth import Guard, KeyStore
from api.auth_grpc import AuthInterceptor
from api.auth_http import AuthGuard
from api.body import BodyLimits
from api.dispatch import Dispatcher
from api.grpc_decode import DecodeGuard
from api.grpc_server import GrpcEndpoint
from api.health import WorkerWatch
from api.infer import ASGIApp, InferRoute
from api.job_routes import jobs_router
from api.metrics import ApiMetrics
from api.repository_control import Repository
from api.routes import VERSION, add_routes
from api.service import InferenceService
from batching.keys import Keys
from batching.repository_scan import scan_repository
from batching.settings import Settings

log = logging.getLogger("conveyor.api")


def create_app(settings: Settings | None = None) -> ASGIApp:
    settings = settings or Settings()
    keys = Keys(settings.key_prefix)
    scan = scan_repository(settings.model_repository, settings.model_filter() or None)
    models = scan.models
    dispatcher = Dispatcher(settings.redis_url, keys, settings.busy_poll_us / 1e6)
    watch = WorkerWatch(dispatcher, keys, models, settings.heartbeat_interval_s,
                        settings.heartbeat_stale_s, broken=scan.failed)
    service = InferenceService(models, dispatcher, watch, keys, ApiMetrics(),
                               BodyLimits.from_settings(settings), broken=scan.failed)
    repository = Repository(settings.model_repository, settings.model_filter() or None, models,
                            service.unloaded, dispatcher, watch, keys, settings.heartbeat_interval_s,
                            failed=scan.failed, control=settings.model_control == "explicit")
    guard = Guard(KeyStore(settings.api_keys_file), settings.auth_health, settings.auth_metrics)
    grpc_endpoint = GrpcEndpoint(service, repository, settings,
                                 [AuthInterceptor(guard), DecodeGuard()])

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await dispatcher.start()
        await repository.start()
        await watch.start()
        await grpc_endpoint.start()
        log.info("conveyor API serving %s from %s", sorted(models), settings.model_repository)
        gc.collect()
        gc.freeze()  # start-up objects never need scanning again (p99, docs/data-path.md section 7)
        yield
        await grpc_endpoint.close()
        await repository.close()
        await watch.close()
        await dispatcher.close()

    app = FastAPI(title="conveyor", version=VERSION, lifespan=lifespan)
    add_routes(app, service, repository)
    app.include_router(jobs_router(service, settings))
    return AuthGuard(InferRoute(app, service), guard)


app = create_app()
