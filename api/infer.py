"""The infer route as a bare ASGI handler, in front of FastAPI.

``POST /v2/models/{m}[/versions/{v}]/infer`` is the hot path: it skips FastAPI's routing,
dependency solving and pydantic, which cost more than the whole Redis round trip
(DESIGN section 10). Every other request falls through to the FastAPI app.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from api.kserve import parse_json, render_json
from api.service import InferenceService
from batching.errors import ConveyorError, Overloaded

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/[^/]+)?/infer$")
JSON_HEADERS = [(b"content-type", b"application/json")]


class InferRoute:
    def __init__(self, app: ASGIApp, service: InferenceService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = INFER_PATH.match(scope["path"])
            if match:
                await self._infer(match.group(1), receive, send)
                return
        await self.app(scope, receive, send)

    async def _infer(self, model: str, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        body = await _read_body(receive)
        try:
            parsed, reply = await self.service.infer(
                model, lambda config: parse_json(body, config), started)
        except ConveyorError as exc:
            headers = list(JSON_HEADERS)
            if isinstance(exc, Overloaded):
                headers.append((b"retry-after", str(exc.retry_after_s).encode()))
            await _respond(send, exc.http_status, orjson.dumps({"error": exc.message}), headers)
            return
        await _respond(send, 200, render_json(model, parsed.id, reply.outputs, parsed.outputs),
                       JSON_HEADERS)


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes,
                   headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
