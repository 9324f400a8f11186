"""Run by tests/test_listeners.py in its own process (api.proto and tritonclient's generated
modules cannot share one): start the gRPC endpoint with the settings of the ``CONVEYOR_*``
environment and a service that is never reached (transport behaviour only), print one JSON
line, and serve until standard input closes.

The line is ``{"serving": true}`` once the endpoint listens, or ``{"bind_error": message}``
when it cannot take its address; the process then exits with :data:`EXIT_BIND_ERROR`.

``python -m tests.grpc_listener_probe``
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from typing import cast

from api.grpc_listener import BindError
from api.grpc_server import GrpcEndpoint
from api.repository_control import Repository
from api.service import InferenceService
from batching.settings import Settings

EXIT_BIND_ERROR = 3


async def serve() -> int:
    service = types.SimpleNamespace(watch=types.SimpleNamespace(server_ready=lambda: True))
    endpoint = GrpcEndpoint(cast(InferenceService, service), cast(Repository, None), Settings())
    try:
        await endpoint.start()
    except BindError as exc:
        print(json.dumps({"bind_error": str(exc)}), flush=True)
        return EXIT_BIND_ERROR
    print(json.dumps({"serving": True}), flush=True)
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        await endpoint.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(serve()))
