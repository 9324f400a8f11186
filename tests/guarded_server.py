"""An ASGI application served by uvicorn with the guarded HTTP protocol
(api/http_guard.py) on a thread of the test process, and a reader of raw responses."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from api.http_guard import ConnectionLimits, guarded_protocol
from tests.procs import free_port


@contextlib.contextmanager
def guarded_server(app: Any, limits: ConnectionLimits) -> Iterator[int]:
    """Serve ``app`` on a free loopback port, yielded; stopped on exit."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                            http=guarded_protocol(limits), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def responses(sock: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """The next ``count`` responses on ``sock`` (each with a Content-Length): head, body."""
    data, out = b"", list[tuple[bytes, bytes]]()
    while len(out) < count:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            if len(rest) >= length:
                out.append((head, rest[:length]))
                data = rest[length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return out


async def send_whole(send: Any, body: bytes) -> None:
    """Answer 200 with ``body`` through ASGI."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
