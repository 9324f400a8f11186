"""HTTP routes of Triton's shared memory extensions.

System shared memory (:mod:`api.shared_memory`): ``GET
/v2/systemsharedmemory[/region/{name}]/status``, ``POST
/v2/systemsharedmemory/region/{name}/register`` with ``{"key", "offset", "byte_size"}``,
``POST /v2/systemsharedmemory[/region/{name}]/unregister`` (no name: every region).
CUDA shared memory is not offered: ``POST /v2/cudasharedmemory/region/{name}/register``
answers 501; its status lists no region and its unregister has nothing to do (Triton's
cleanup calls in its clients' examples succeed).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from api.routes import json_body
from api.shared_memory import CUDA_UNSUPPORTED, SharedMemory
from api.shm_params import U64_MAX
from batching.errors import InvalidInput, Unsupported


def register_fields(body: dict[str, Any]) -> tuple[str, int, int]:
    """(key, offset, byte_size) of a register request; Triton's messages."""
    for field in ("key", "byte_size"):
        if field not in body:
            raise InvalidInput(f"Shared memory register request has no '{field}' field")
    key, offset, byte_size = body["key"], body.get("offset", 0), body["byte_size"]
    if not isinstance(key, str):
        raise InvalidInput("Shared memory register request: 'key' must be a string")
    for field, value in (("offset", offset), ("byte_size", byte_size)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64_MAX:
            raise InvalidInput(f"Shared memory register request: '{field}' must be a "
                               "non-negative integer")
    return key, offset, byte_size


def add_shm_routes(app: FastAPI, shm: SharedMemory) -> None:
    @app.get("/v2/systemsharedmemory/status")
    @app.get("/v2/systemsharedmemory/region/{name}/status")
    async def status(name: str = "") -> JSONResponse:
        return JSONResponse(await shm.status(name))

    @app.post("/v2/systemsharedmemory/region/{name}/register")
    async def register(name: str, request: Request) -> JSONResponse:
        await shm.register(name, *register_fields(await json_body(request)))
        return JSONResponse({})

    @app.post("/v2/systemsharedmemory/unregister")
    @app.post("/v2/systemsharedmemory/region/{name}/unregister")
    async def unregister(request: Request, name: str = "") -> JSONResponse:
        await json_body(request)
        await shm.unregister(name)
        return JSONResponse({})

    @app.get("/v2/cudasharedmemory/status")
    @app.get("/v2/cudasharedmemory/region/{name}/status")
    async def cuda_status(name: str = "") -> JSONResponse:
        return JSONResponse(await shm.cuda_status(name))

    # Not in the OpenAPI schema: it exists only to refuse.
    @app.post("/v2/cudasharedmemory/region/{name}/register", include_in_schema=False)
    async def cuda_register(name: str) -> JSONResponse:
        raise Unsupported(CUDA_UNSUPPORTED)

    @app.post("/v2/cudasharedmemory/unregister")
    @app.post("/v2/cudasharedmemory/region/{name}/unregister")
    async def cuda_unregister(request: Request, name: str = "") -> JSONResponse:
        await json_body(request)
        return JSONResponse({})
