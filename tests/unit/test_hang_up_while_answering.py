"""A client that hangs up while its answer is being sent ends the send, nothing more: the
request is not cancelled then (it was answered), so no error escapes the application."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi.testclient import TestClient

from api.http_guard import DISCONNECT_HOOK

BODY = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                 "data": [0, 1, 2, 3]}]})


def hang_up_during_send(client: TestClient, path: str) -> list[int]:
    """Run one POST through the application; the connection is lost as the response starts
    (the guard then calls the scope's hook, as api/http_guard.py does). The statuses sent."""
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(BODY)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
            hook = scope.get(DISCONNECT_HOOK)
            if hook is not None:
                hook()
            await asyncio.sleep(0)  # the transport writes: a cancelled task stops here

    async def run() -> None:
        await client.app(scope, receive, send)  # type: ignore[arg-type]

    client.portal.call(run)  # type: ignore[union-attr]
    return statuses


def test_an_answer_whose_client_hangs_up_mid_send_raises_nothing(client: TestClient) -> None:
    assert hang_up_during_send(client, "/v2/models/echo/infer") == [200]


def test_an_error_whose_client_hangs_up_mid_send_raises_nothing(client: TestClient) -> None:
    assert hang_up_during_send(client, "/v2/models/slow/infer") == [503]  # no worker
