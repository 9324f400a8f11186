"""The API process entry point: ``python -m api.serve``.

uvicorn, built here rather than from its command line, serves the application of
:func:`api.main.create_app` on ``CONVEYOR_HOST``:``CONVEYOR_HTTP_PORT`` with the
connection guards of :mod:`api.http_guard`, TLS when ``CONVEYOR_TLS_CERT_FILE`` and
``CONVEYOR_TLS_KEY_FILE`` are set, and no access log. uvicorn's proxy-headers layer is
off: nothing reads the client address or scheme it would rewrite, and it is one more
call per request. gRPC starts with the application
(``api.main``). ``CONVEYOR_API_WORKERS`` processes (default: half the cores) share both
ports (:mod:`api.process_pool`). It refuses to start (exit status 2) on an address beyond
loopback without API keys.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import sys
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from api.http_guard import ConnectionLimits, guarded_protocol
from batching.exposure import unsafe_binding
from batching.settings import Settings

if TYPE_CHECKING:
    from api.infer import ASGIApp

EXIT_REFUSED = 2


def config(settings: Settings, app: ASGIApp) -> uvicorn.Config:
    tls = settings.tls_cert_file is not None
    return uvicorn.Config(
        app, host=settings.host, port=settings.http_port, access_log=False,
        proxy_headers=False,
        http=guarded_protocol(ConnectionLimits.from_settings(settings)),
        ssl_certfile=settings.tls_cert_file if tls else None,
        ssl_keyfile=settings.tls_key_file if tls else None,
        ssl_ca_certs=settings.tls_client_ca_file if tls else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls and settings.tls_client_ca_file
        else ssl.CERT_NONE)


def main() -> int:
    settings = Settings()
    refusal = unsafe_binding(settings)
    if refusal is not None:
        print(f"conveyor API: refusing to start: {refusal}", file=sys.stderr)
        return EXIT_REFUSED
    processes = settings.api_processes()
    if processes == 1:
        return serve(settings)
    with shared_metrics_dir():
        from api.process_pool import ProcessPool

        settings = settings.model_copy(update={"grpc_reuseport": True})
        sock = uvicorn.Config("api.main:create_app", host=settings.host,
                              port=settings.http_port).bind_socket()
        return ProcessPool(processes, lambda: serve(settings, sock)).run()


@contextlib.contextmanager
def shared_metrics_dir() -> Iterator[None]:
    """``PROMETHEUS_MULTIPROC_DIR`` for the API processes, unless one is set: a fresh
    folder, removed when they have stopped, so that a scrape of any process counts all of
    them (docs/metrics.md). Set before anything imports prometheus_client."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        yield
        return
    folder = tempfile.mkdtemp(prefix="conveyor-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def serve(settings: Settings, sock: socket.socket | None = None) -> int:
    """One API process: its application, served on ``sock`` (shared with other API
    processes) or on a socket of its own; its exit status."""
    from api.main import create_app  # a refused start loads nothing of the application

    server = uvicorn.Server(config(settings, create_app(settings)))
    server.run(sockets=None if sock is None else [sock])
    return 0 if server.started else STARTUP_FAILURE


if __name__ == "__main__":
    sys.exit(main())
