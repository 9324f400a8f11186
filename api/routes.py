"""The FastAPI app: every route except the infer hot path (see :mod:`api.infer`).

KServe v2 / Triton: server and model metadata, health, ``/config`` (Triton's ModelConfig
JSON), ``/stats`` (Triton's statistics), and repository control (index, load, unload).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from api.kserve import json_object
from api.repository_control import Repository
from api.service import InferenceService
from api.stats import statistics
from batching.config import ModelConfig
from batching.errors import ConveyorError, FilesRefused, InvalidInput, Overloaded, Unavailable
from batching.triton_config import ensemble_config, triton_config

_READY_TYPE = "Invalid value for 'ready': expected a boolean"
_DEPTH_EXCEEDED = "depth limit exceeded"
"""orjson's words for a body nested past its bound (1024)."""
_STRING = re.compile(rb'"(ready)"|"[^"]*"')
"""A JSON string without escaped quotes; the key ``"ready"`` is kept, any other emptied."""
_READY_MEMBER = re.compile(rb'"ready"\s*:\s*(\S)')
"""A ``ready`` key and the first character of its value."""
READY_WINDOW = 64 * 1024
"""How far into a body too deep to parse its top-level ``ready`` is looked for."""

VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "parameters",
              "schedule_policy", "statistics", "system_shared_memory"]


def error_response(exc: ConveyorError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Overloaded) else None
    return JSONResponse({"error": exc.message}, status_code=exc.http_status, headers=headers)


def server_metadata(name: str) -> dict[str, Any]:
    """``GET /v2`` and gRPC ``ServerMetadata``; ``name`` is ``CONVEYOR_SERVER_NAME``."""
    return {"name": name, "version": VERSION, "extensions": EXTENSIONS}


def metadata(config: ModelConfig) -> dict[str, Any]:
    return {
        "name": config.name,
        "versions": list(config.served_versions),
        "platform": config.backend,
        "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                   for t in config.inputs],
        "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                    for t in config.outputs],
    }


async def json_body(request: Request) -> dict[str, Any]:
    """A control request's JSON object; an empty body is an empty object."""
    raw = await request.body()
    if not raw.strip():
        return {}
    return json_object(raw)


def index_ready(raw: bytes) -> bool:
    """The ``ready`` flag of a repository index body (an empty body: false). As in Triton,
    a ``ready`` that is not a boolean is answered before the body's depth: in a body nested
    past the parser's bound, a top-level ``ready`` whose value is not a boolean and starts
    within the first :data:`READY_WINDOW` bytes answers that, not the depth."""
    try:
        doc = json_object(raw) if raw.strip() else {}
    except InvalidInput as exc:
        if _DEPTH_EXCEEDED in exc.message and _ready_is_not_bool(raw[:READY_WINDOW]):
            raise InvalidInput(_READY_TYPE) from None
        raise
    ready = doc.get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidInput(_READY_TYPE)
    return ready


def _ready_is_not_bool(raw: bytes) -> bool:
    """Whether the first ``"ready"`` member of the top-level object in ``raw``, read from its
    tokens as it cannot be parsed, has a value other than ``true`` or ``false``."""
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")  # no quote is escaped now
    bare = _STRING.sub(rb'"\1"', unescaped)  # brackets in strings no longer count
    if not bare.lstrip().startswith(b"{"):
        return False
    depth, at = 0, 0
    for member in _READY_MEMBER.finditer(bare):
        part = bare[at:member.start()]
        depth += part.count(b"{") + part.count(b"[") - part.count(b"}") - part.count(b"]")
        at = member.start()
        if depth == 1:
            return member.group(1) not in (b"t", b"f")
    return False


def load_config(parameters: Any) -> str | None:
    """A load's ``config`` parameter (a ModelConfig in Triton's JSON form), if given.
    Model files come from the model's folder only, never from a client: ``file:`` is
    refused."""
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be an object")
    files = sorted(k for k in parameters if k.startswith("file:"))
    if files:
        raise FilesRefused(f"failed to poll from model repository: load parameters {files} "
                           "are not supported: conveyor loads a model's files from its "
                           "folder in the repository, never from a client")
    config = parameters.get("config")
    if config is not None and not isinstance(config, str):
        raise InvalidInput("load parameter 'config' must be a string holding the model "
                           "configuration as JSON")
    return config


def add_routes(app: FastAPI, service: InferenceService, repository: Repository,
               server_name: str = "conveyor") -> None:
    @app.exception_handler(ConveyorError)
    async def conveyor_error(_: Request, exc: ConveyorError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        """Unknown paths (404), wrong methods (405) and the like: ``{"error": ...}`` too."""
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        """A bug: 500 with ``{"error": ...}`` too (Starlette still logs the traceback)."""
        return JSONResponse({"error": f"internal error: {type(exc).__name__}"}, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}"
                             for e in exc.errors())
        return JSONResponse({"error": f"invalid request: {problems}"}, status_code=422)

    @app.get("/v2")
    async def get_server_metadata() -> dict[str, Any]:
        return server_metadata(server_name)

    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready() -> JSONResponse:
        ok = service.watch.server_ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2/models/stats")
    async def all_stats() -> dict[str, Any]:
        return await statistics(service.dispatcher.redis, service.keys,
                                sorted([*service.models, *service.ensembles.plans]))

    @app.get("/v2/models/{model}")
    @app.get("/v2/models/{model}/versions/{version}")
    async def model_metadata(model: str, version: str = "") -> dict[str, Any]:
        return metadata(service.model(model, version))

    @app.get("/v2/models/{model}/ready")
    @app.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str = "") -> JSONResponse:
        service.model(model, version)
        if not service.model_ready(model):
            failure = service.watch.failure(model)
            why = f"failed to load: {failure[1]}" if failure else "has no ready worker"
            return error_response(Unavailable(f"model {model!r} {why}"))
        return JSONResponse({"name": model, "ready": True})

    @app.get("/v2/models/{model}/config")
    @app.get("/v2/models/{model}/versions/{version}/config")
    async def model_config(model: str, version: str = "") -> dict[str, Any]:
        config = service.model(model, version)
        plan = service.ensembles.plans.get(model)
        return triton_config(config) if plan is None else ensemble_config(plan)

    @app.get("/v2/models/{model}/stats")
    @app.get("/v2/models/{model}/versions/{version}/stats")
    async def model_stats(model: str, version: str = "") -> dict[str, Any]:
        service.model(model, version)
        return await statistics(service.dispatcher.redis, service.keys, [model])

    @app.post("/v2/repository/index")
    async def repository_index(request: Request) -> JSONResponse:
        ready = index_ready(await request.body())
        return JSONResponse(await repository.index(ready_only=ready))

    @app.post("/v2/repository/models/{model}/load")
    async def load(model: str, request: Request) -> JSONResponse:
        config = load_config((await json_body(request)).get("parameters") or {})
        await repository.load(model, config)
        return JSONResponse({})

    @app.post("/v2/repository/models/{model}/unload")
    async def unload(model: str, request: Request) -> JSONResponse:
        await json_body(request)
        await repository.unload(model)
        return JSONResponse({})

    @app.head("/metrics")
    async def metrics_head() -> Response:
        """A GET's headers without its body: the length is that of the text a scrape got
        now, from the state last read (Redis is not read for a HEAD)."""
        length = len(service.metrics.exposition())
        return Response(media_type=CONTENT_TYPE_LATEST, headers={"content-length": str(length)})

    @app.get("/metrics")
    async def metrics() -> Response:
        index = await repository.index(reasons=False)
        service.metrics.set_model_states({e["name"]: e["state"] for e in index})
        await service.metrics.refresh(service.dispatcher.redis, service.keys, service.models,
                                      {m: w.states for m, w in service.watch.view.items()})
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
