"""The HTTP listener under test: ``python -m api.serve`` started for a test module, raw
sockets to it, and what they read (tests/test_listeners.py, tests/test_listener_timeouts.py,
tests/test_slow_bodies.py)."""

from __future__ import annotations

import socket
import ssl
import sys
import time
import uuid
from pathlib import Path

import httpx

from tests.conftest import TEST_MODELS
from tests.procs import Proc, RedisServer, free_port, service_env, wait_for


def listening_hosts(port: int) -> set[str]:
    """Addresses with a TCP socket listening on ``port``, read from /proc/net/tcp{,6}."""
    hosts: set[str] = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:
                continue
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            hosts.add(socket.inet_ntop(family, packed))
    return hosts

def start_serve(redis_server: RedisServer, logdir: Path, name: str,
                **env: str) -> tuple[Proc, int]:
    """The API, not yet live, and its HTTP port (its gRPC port: ``CONVEYOR_GRPC_PORT`` in
    ``env``, else a free one)."""
    port = free_port()
    env.setdefault("CONVEYOR_GRPC_PORT", str(free_port()))
    full = service_env(redis_server.url, TEST_MODELS, f"l{uuid.uuid4().hex[:8]}",
                       CONVEYOR_HTTP_PORT=str(port), **env)
    return Proc(f"{name}-{port}", [sys.executable, "-m", "api.serve"], full, logdir), port


def wait_live(proc: Proc, url: str, verify: ssl.SSLContext | bool = True) -> None:
    try:
        wait_for(lambda: httpx.get(f"{url}/v2/health/live", verify=verify).status_code == 200,
                 60, f"{proc.name} to go live")
    except AssertionError:
        proc.stop()
        raise AssertionError(proc.log()) from None


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(0.1)
    return sock


def closed(sock: socket.socket) -> bool:
    """The server closed the connection (anything it sent first is discarded)."""
    try:
        while data := sock.recv(65536):
            del data
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def trickle_until_closed(sock: socket.socket, chunk: bytes, every_s: float, limit_s: float) -> float:
    """Send ``chunk`` every ``every_s`` until the server closes; seconds until then."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started
        deadline = time.monotonic() + every_s
        while time.monotonic() < deadline:
            if closed(sock):
                return time.monotonic() - started
    raise AssertionError(f"connection still open after {limit_s} s")


def read_response(sock: socket.socket, limit_s: float = 10) -> bytes:
    """One response with a Content-Length body (the connection stays open)."""
    data = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            chunk = None
        if chunk == b"":
            return data
        data += chunk or b""
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            if len(body) >= length:
                return data
    raise AssertionError(f"no complete response within {limit_s} s: {data!r}")


LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
