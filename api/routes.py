"""The FastAPI app: every route except the infer hot path (see :mod:`api.infer`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.service import InferenceService
from batching.config import ModelConfig
from batching.errors import ConveyorError, Overloaded, Unavailable

VERSION = "0.1.0"


def error_response(exc: ConveyorError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Overloaded) else None
    return JSONResponse({"error": exc.message}, status_code=exc.http_status, headers=headers)


def metadata(config: ModelConfig) -> dict[str, Any]:
    return {
        "name": config.name,
        "versions": ["1"],
        "platform": config.backend,
        "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                   for t in config.inputs],
        "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                    for t in config.outputs],
    }


def add_routes(app: FastAPI, service: InferenceService) -> None:
    @app.exception_handler(ConveyorError)
    async def conveyor_error(_: Request, exc: ConveyorError) -> JSONResponse:
        return error_response(exc)

    @app.get("/v2")
    async def server_metadata() -> dict[str, Any]:
        return {"name": "conveyor", "version": VERSION, "extensions": []}

    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready() -> JSONResponse:
        ok = service.watch.server_ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2/models/{model}")
    @app.get("/v2/models/{model}/versions/{version}")
    async def model_metadata(model: str, version: str = "1") -> dict[str, Any]:
        return metadata(service.model(model))

    @app.get("/v2/models/{model}/ready")
    @app.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str = "1") -> JSONResponse:
        service.model(model)
        ok = service.watch.model_ready(model)
        if not ok:
            return error_response(Unavailable(f"model {model!r} has no ready worker"))
        return JSONResponse({"name": model, "ready": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
