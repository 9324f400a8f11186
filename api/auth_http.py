"""The HTTP side of authentication: an ASGI wrapper around the whole app.

It sits outside the infer hot path (:class:`api.infer.InferRoute`) and FastAPI alike, so
every request is checked before any of its body is read. A refusal is a 401 (no or an
unknown key; ``WWW-Authenticate: Bearer``) or a 403 (a known key without the scope),
with the usual ``{"error": ...}`` body. The caller's :class:`api.auth.Principal` (None
when there are no keys) is left in the ASGI scope under :data:`api.auth.PRINCIPAL`.
"""

from __future__ import annotations

import re

import orjson

from api.auth import PRINCIPAL, Guard, Need
from api.infer import ASGIApp, Receive, Scope, Send
from api.queue_routes import PATH as QUEUES_PATH
from batching.errors import ConveyorError, PermissionDenied

HEALTH_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
CONTROL_PATH = re.compile(r"^/v2/repository/models/[^/]+/(?:load|unload)$")
SHARED_MEMORY_PATHS = ("/v2/systemsharedmemory/", "/v2/cudasharedmemory/")


def http_need(path: str) -> Need:
    """The scope table of docs/security.md for an HTTP path."""
    if path in HEALTH_PATHS:
        return Need.HEALTH
    if path in ("/metrics", QUEUES_PATH):
        return Need.METRICS
    if path == "/v1/jobs" or path.startswith("/v1/jobs/"):
        return Need.JOBS
    if CONTROL_PATH.match(path):
        return Need.ADMIN
    if (path in ("/v2", "/v2/repository/index") or path.startswith("/v2/models/")
            or path.startswith(SHARED_MEMORY_PATHS) or path in DOCS_PATHS):
        return Need.INFER
    return Need.ANY


class AuthGuard:
    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        credentials = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                credentials = value.decode("latin-1")
                break
        try:
            scope[PRINCIPAL] = self.guard.check(http_need(scope["path"]), credentials)
        except ConveyorError as exc:
            challenge = (b'Bearer error="insufficient_scope"' if isinstance(exc, PermissionDenied)
                         else b"Bearer")
            body = orjson.dumps({"error": exc.message})
            await send({"type": "http.response.start", "status": exc.http_status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"www-authenticate", challenge),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)
