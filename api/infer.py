"""The infer route as a bare ASGI handler, in front of FastAPI.

``POST /v2/models/{m}[/versions/{v}]/infer`` is the hot path: it skips FastAPI's routing,
dependency solving and pydantic, which cost more than the whole Redis round trip
(docs/data-path.md section 7). Every other request falls through to the FastAPI app.

It speaks JSON and the binary tensor extension: ``Inference-Header-Content-Length``
splits the body into a JSON header and raw tensors (``0``: the whole body is the raw
data of the model's one input); gzip and deflate request bodies are accepted and the
response is compressed when ``Accept-Encoding`` asks for it. The model is looked up
before the body is read, and the body is read, inflated and parsed within the limits of
:mod:`api.body` (413 past ``max_request_bytes``). A client that hangs up before its answer
cancels its request (:data:`api.http_guard.DISCONNECT_HOOK`): a queued request is
withdrawn and never runs, and nothing is answered.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from api.binary import compress, raw_input
from api.body import content_length, drain, inflate, read_body
from api.http_direct import cycle_of, ready_body, write_response
from api.http_guard import DISCONNECT_HOOK, QUIET_SINCE, RECEIVED_AT
from api.kserve import InferRequest, Vet, parse_header, render
from api.service import InferenceService
from batching.config import ModelConfig
from batching.errors import ConveyorError, InvalidInput, Overloaded
from batching.signature import check_inputs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
JSON_TYPE = b"application/json"
BINARY_TYPE = b"application/octet-stream"
HEADER_LENGTH = b"inference-header-content-length"


class InferRoute:
    def __init__(self, app: ASGIApp, service: InferenceService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = INFER_PATH.match(scope["path"])
            if match:
                await self._infer(match.group(1), match.group(2) or "", scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _infer(self, model: str, version: str, scope: Scope, receive: Receive,
                     send: Send) -> None:
        started = scope.get(RECEIVED_AT) or time.perf_counter()
        headers: dict[bytes, bytes] = dict(scope["headers"])
        header_length = headers.get(HEADER_LENGTH)
        protocol = "http_json" if header_length is None else "http_binary"
        limits = self.service.bodies
        declared = content_length(headers.get(b"content-length"))
        read = False
        task = asyncio.current_task()
        gone = False
        cycle = cycle_of(scope)

        def hang_up() -> None:
            nonlocal gone
            gone = True
            if task is not None:
                task.cancel()

        scope[DISCONNECT_HOOK] = hang_up

        async def parse(config: ModelConfig, vet: Vet) -> InferRequest:
            """Read, inflate and parse the body; a large one holds a place while it does
            (and is parsed in a thread, without ``vet``: the service checks it after)."""
            nonlocal read
            async with limits.claim() as claim:
                body = await read_body(receive, claim, declared, limits.max_bytes,
                                       ready=None if cycle is None else ready_body(cycle))
                read = True
                encoding = headers.get(b"content-encoding")
                if encoding is not None:
                    body = await inflate(body, encoding.decode("latin-1"), claim, limits.max_bytes)
                if claim.held:
                    return await asyncio.to_thread(_parse, body, header_length, config)
                return _parse(body, header_length, config, vet)

        try:
            parsed, reply = await self.service.infer(model, parse, started, protocol, version,
                                                     scope.get(QUIET_SINCE))
            content, json_length = render(model, parsed, reply.outputs)
        except asyncio.CancelledError:
            if gone:  # the client left: the request is withdrawn, nobody to answer
                return
            raise
        except ConveyorError as exc:
            scope.pop(DISCONNECT_HOOK, None)  # answering now: a hang-up only ends the send
            extra = []
            if isinstance(exc, Overloaded):
                extra.append((b"retry-after", str(exc.retry_after_s).encode()))
            if not read:  # answered before the body was read: skip a small one, else hang up
                if declared is not None and declared < limits.large_bytes:
                    await drain(receive)
                else:
                    extra.append((b"connection", b"close"))
            await _respond(cycle, send, exc.http_status, orjson.dumps({"error": exc.message}),
                           [(b"content-type", JSON_TYPE), *extra])
            return
        scope.pop(DISCONNECT_HOOK, None)
        out = [(b"content-type", JSON_TYPE if json_length is None else BINARY_TYPE)]
        if json_length is not None:
            out.append((HEADER_LENGTH, str(json_length).encode()))
        accept = headers.get(b"accept-encoding")
        if accept:
            content, encoding = compress(content, accept.decode("latin-1"))
            if encoding:
                out.append((b"content-encoding", encoding.encode()))
        await _respond(cycle, send, 200, content, out)


def _parse(body: bytes, header_length: bytes | None, config: ModelConfig,
           vet: Vet | None = None) -> InferRequest:
    if header_length is None:
        return parse_header(body, memoryview(b""), config, vet)
    length = content_length(header_length)
    if length is None:
        raise InvalidInput("Inference-Header-Content-Length must be an integer of ASCII "
                           f"digits, got {header_length.decode('latin-1')!r}")
    if length == 0:
        tensor = raw_input(body, config)
        rows = check_inputs(config, [(tensor.name, tensor.datatype, tensor.shape)])
        return InferRequest(id=None, inputs=[tensor], rows=rows, binary_default=True)
    if length > len(body):
        raise InvalidInput(f"Inference-Header-Content-Length {length} does not fit a body of "
                           f"{len(body)} bytes")
    view = memoryview(body)
    return parse_header(view[:length], view[length:], config, vet)


async def _respond(cycle: RequestResponseCycle | None, send: Send, status: int, body: bytes,
                   headers: list[tuple[bytes, bytes]]) -> None:
    """The response in one write to the connection (api/http_direct.py), or as ASGI."""
    if cycle is not None and write_response(cycle, status, headers, body):
        return
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
