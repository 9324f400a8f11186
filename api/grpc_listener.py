"""How the gRPC server listens: its address, TLS credentials and transport options.

Messages are bounded by ``CONVEYOR_MAX_REQUEST_BYTES`` both ways (a larger one is
RESOURCE_EXHAUSTED from gRPC itself, before any handler runs); idle connections are
closed, dead peers are found by keepalive pings, and one connection carries a bounded
number of concurrent streams. SO_REUSEPORT only with ``CONVEYOR_GRPC_REUSEPORT``: without
it a port another program holds is an error at start, never a silently shared port.
"""

from __future__ import annotations

import grpc

from batching.settings import Settings

MAX_CONNECTION_IDLE_MS = 300_000
"""A connection with no RPC for this long is sent GOAWAY (clients reconnect on demand)."""
KEEPALIVE_TIME_MS = 60_000
"""The server pings a connection silent for this long ..."""
KEEPALIVE_TIMEOUT_MS = 20_000
"""... and closes it when the ping is not answered within this long."""
MAX_CONCURRENT_STREAMS = 1024
"""RPCs in flight on one connection; more wait in the client for a free stream."""


class BindError(RuntimeError):
    """The gRPC listener could not take its address (port in use, or not this host's)."""


def server_options(settings: Settings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_request_bytes),
        ("grpc.max_send_message_length", settings.max_request_bytes),
        ("grpc.so_reuseport", int(settings.grpc_reuseport)),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
    ]


def address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS when a certificate is configured; mutual TLS when a client CA is too."""
    if settings.tls_cert_file is None:
        return None
    if settings.tls_key_file is None:
        raise BindError("CONVEYOR_TLS_CERT_FILE is set without CONVEYOR_TLS_KEY_FILE")
    client_ca = (settings.tls_client_ca_file.read_bytes()
                 if settings.tls_client_ca_file is not None else None)
    return grpc.ssl_server_credentials(
        [(settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())],
        root_certificates=client_ca, require_client_auth=client_ca is not None)


def add_port(server: grpc.aio.Server, settings: Settings) -> int:
    """Bind ``settings.host:settings.grpc_port`` (TLS or not); the port bound."""
    where = address(settings.host, settings.grpc_port)
    tls = credentials(settings)
    try:
        port: int = (server.add_secure_port(where, tls) if tls is not None
                else server.add_insecure_port(where))
    except RuntimeError:
        port = 0
    if port == 0:
        raise BindError(bind_failure(where))
    return port


def bind_failure(where: str) -> str:
    return (f"gRPC cannot listen on {where}: the port is in use (set CONVEYOR_GRPC_PORT, or "
            "CONVEYOR_GRPC_REUSEPORT=1 to share it with other API processes) or the address "
            "is not this host's (CONVEYOR_HOST)")
