"""The worker's own probes: a tiny HTTP server in the Celery main process.

``/live``: the supervisor thread runs (never depends on Redis or the models).
``/ready``: every inference process this worker supervises has loaded its model.
It listens on ``CONVEYOR_HOST`` (loopback by default; in a container, ``0.0.0.0`` so
that the kubelet can reach it).
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from workers.supervisor import Supervisor


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def start_probe(supervisor: Supervisor, host: str, port: int) -> ThreadingHTTPServer:
    """Serve the probes on ``host:port`` (``CONVEYOR_HOST``, ``CONVEYOR_WORKER_PORT``)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path in ("/live", "/healthz"):
                ok = supervisor.alive()
            elif self.path == "/ready":
                ok = supervisor.ready()
            else:
                self.send_error(404)
                return
            body = json.dumps({"ok": ok, "slots": [
                {"model": s.model, "device": s.device, "ready": s.ready, "failed": s.failed,
                 "restarts": s.restarts} for s in supervisor.slots]}).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Probes every few seconds would flood the worker log."""

    bare = host.strip("[]")
    server = (_IPv6Server if ":" in bare else ThreadingHTTPServer)((bare, port), Handler)
    threading.Thread(target=server.serve_forever, name="conveyor-probe", daemon=True).start()
    return server
