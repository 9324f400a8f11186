"""The native gRPC listener: KServe v2 / Triton gRPC and ``grpc.health.v1`` served over
conveyor's own HTTP/2 (:mod:`api.h2_connection`, :mod:`api.grpc_calls`) in the API's
event loop, with ``CONVEYOR_GRPC_SERVER=native`` (the default).

The methods are the same servicer's as under grpc.aio (:mod:`api.grpc_server`); what
changes is the transport: no completion queue, no thread hand-off per call, and every
response of one event-loop tick on a connection leaves in one write
(docs/data-path.md). It keeps grpc.aio's listener contract: messages bounded by
``CONVEYOR_MAX_REQUEST_BYTES`` both ways (RESOURCE_EXHAUSTED), 1,024 streams per
connection, idle connections closed, dead peers found by keepalive pings, TLS (ALPN
``h2``) and client certificates, SO_REUSEPORT only with ``CONVEYOR_GRPC_REUSEPORT``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import message_factory
from grpc_health.v1 import health_pb2

from api import grpc_listener
from api.auth import Guard
from api.grpc_calls import Abort, CallEnv, Context, GrpcCall, Method
from api.grpc_server import SERVICE_NAME, STOP_GRACE_S, InferenceServicer
from api.h2_connection import H2Connection, Limits, StreamSink
from api.periodic import Periodic
from api.proto import inference_pb2 as pb
from api.repository_control import Repository
from api.service import InferenceService
from batching.settings import Settings

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
NOT_FOUND = 5


class Health:
    """``grpc.health.v1.Health``: the server ("") and the inference service, kept in step
    with readiness; Watch sends the status, then each change."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Event()

    def set(self, status: int) -> None:
        if any(self._status.get(name) != status for name in ("", SERVICE_NAME)):
            self._status = {"": status, SERVICE_NAME: status}
            self._changed.set()
            self._changed = asyncio.Event()

    def serve_nothing(self) -> None:
        self.set(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Check(self, request: Any, context: Context) -> Any:
        status = self._status.get(request.service)
        if status is None:
            raise Abort(NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: Context) -> AsyncIterator[Any]:
        last = None
        while True:
            changed = self._changed
            status = self._status.get(request.service,
                                      health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await changed.wait()


def method_table(servicer: Any, health: Health) -> dict[str, Method]:
    """``/package.Service/Method`` to its request type and behaviour, from the descriptors."""
    table: dict[str, Method] = {}
    services = ((pb.DESCRIPTOR.services_by_name["GRPCInferenceService"], servicer),
                (health_pb2.DESCRIPTOR.services_by_name["Health"], health))
    for service, implementation in services:
        for method in service.methods:
            behaviour = getattr(implementation, method.name, None)
            if behaviour is None:  # a method a newer proto has and conveyor does not serve
                continue           # answers UNIMPLEMENTED
            table[f"/{service.full_name}/{method.name}"] = Method(
                message_factory.GetMessageClass(method.input_type), behaviour,
                method.client_streaming, method.server_streaming)
    return table


class _App:
    def __init__(self, env: CallEnv) -> None:
        self.env = env
        self.connections: set[H2Connection] = set()

    def open_stream(self, conn: H2Connection, stream_id: int,
                    headers: list[tuple[str, str]]) -> StreamSink:
        return GrpcCall(self.env, conn, stream_id, headers)

    def connection(self, limits: Limits) -> H2Connection:
        return _TrackedConnection(self, limits)


class _TrackedConnection(H2Connection):
    def __init__(self, app: _App, limits: Limits) -> None:
        super().__init__(app, limits)
        self._owner = app

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._owner.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner.connections.discard(self)
        super().connection_lost(exc)


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """TLS 1.2+ with ALPN h2 when a certificate is configured; client certificates
    required when a client CA is."""
    if settings.tls_cert_file is None:
        return None
    if settings.tls_key_file is None:
        raise grpc_listener.BindError("CONVEYOR_TLS_CERT_FILE is set without CONVEYOR_TLS_KEY_FILE")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    context.set_alpn_protocols(["h2"])
    if settings.tls_client_ca_file is not None:
        context.load_verify_locations(settings.tls_client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class NativeGrpcEndpoint:
    """The listener, its connections and the task that keeps health in step with readiness."""

    def __init__(self, service: InferenceService, repository: Repository, settings: Settings,
                 guard: Guard) -> None:
        self._service = service
        self._settings = settings
        self._health = Health()
        servicer = InferenceServicer(service, repository, settings.server_name)
        self._app = _App(CallEnv(method_table(servicer, self._health), guard,
                                 settings.max_request_bytes))
        self._limits = Limits(settings.max_request_bytes + (1 << 20),
                              grpc_listener.MAX_CONCURRENT_STREAMS,
                              grpc_listener.MAX_CONNECTION_IDLE_MS / 1000,
                              grpc_listener.KEEPALIVE_TIME_MS / 1000,
                              grpc_listener.KEEPALIVE_TIMEOUT_MS / 1000,
                              settings.http_body_timeout_s)
        self._loop = Periodic("conveyor-grpc-health", settings.heartbeat_interval_s,
                              self._update_health)
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        settings = self._settings
        where = grpc_listener.address(settings.host, settings.grpc_port)
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: self._app.connection(self._limits), settings.host.strip("[]"),
                settings.grpc_port, ssl=tls_context(settings),
                reuse_port=settings.grpc_reuseport or None, backlog=2048)
        except OSError as exc:
            raise grpc_listener.BindError(grpc_listener.bind_failure(where)) from exc
        await self._update_health()
        self._loop.start()
        log.info("gRPC serving on %s%s", grpc_listener.address(settings.host, self.port),
                 " (TLS)" if settings.tls_cert_file is not None else "")

    async def close(self) -> None:
        await self._loop.close()
        self._health.serve_nothing()
        if self._server is not None:
            self._server.close()
        for conn in list(self._app.connections):
            conn.shut_down()
        calls = set(self._app.env.calls)
        if calls:
            _, running = await asyncio.wait(calls, timeout=STOP_GRACE_S)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        await asyncio.sleep(0)  # the last answers' writes
        for conn in list(self._app.connections):
            conn.close()

    async def _update_health(self) -> None:
        self._health.set(health_pb2.HealthCheckResponse.SERVING
                         if self._service.watch.server_ready()
                         else health_pb2.HealthCheckResponse.NOT_SERVING)
