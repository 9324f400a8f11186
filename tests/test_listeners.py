"""Listeners: bind address, TLS, connection guards (``python -m api.serve``) and gRPC limits.

Never import ``api.proto`` here, directly or through ``api.grpc_server`` or ``api.main``: its
``inference.*`` symbols would collide with tritonclient's in one process's descriptor pool.
The gRPC endpoint runs in tests/grpc_listener_probe.py or in the API process instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import pytest
from uvicorn.config import STARTUP_FAILURE

from api import grpc_listener
from api.http_guard import MAX_HEADER_BYTES, ConnectionLimits, GuardedHttpProtocol
from api.serve import EXIT_REFUSED, config
from batching.exposure import is_loopback, unsafe_binding
from batching.settings import Settings
from tests.conftest import TEST_MODELS
from tests.procs import ROOT, Proc, RedisServer, free_port, service_env, wait_for
from workers.probe import start_probe
from workers.supervisor import Supervisor

# --- Binding policy ------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost",
                                  "LOCALHOST", "api.localhost"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)
    assert unsafe_binding(Settings(host=host)) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.7", "example.com", "localhost.evil"])
def test_other_hosts_need_keys_or_an_explicit_opt_out(host: str, tmp_path: Path) -> None:
    assert not is_loopback(host)
    message = unsafe_binding(Settings(host=host))
    assert message is not None
    assert "CONVEYOR_API_KEYS_FILE" in message and "CONVEYOR_ALLOW_UNAUTHENTICATED=1" in message
    assert unsafe_binding(Settings(host=host, api_keys_file=tmp_path / "keys")) is None
    assert unsafe_binding(Settings(host=host, allow_unauthenticated=True)) is None


def test_serve_refuses_an_unauthenticated_public_binding() -> None:
    env = service_env("redis://127.0.0.1:1/0", TEST_MODELS, "refused", CONVEYOR_HOST="0.0.0.0")
    done = subprocess.run([sys.executable, "-m", "api.serve"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_REFUSED
    assert "listening on 0.0.0.0 without CONVEYOR_API_KEYS_FILE" in done.stderr


# --- Helpers -------------------------------------------------------------------------------


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


def make_cert(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def start_serve(redis_server: RedisServer, logdir: Path, name: str,
                **env: str) -> tuple[Proc, int]:
    port = free_port()
    full = service_env(redis_server.url, TEST_MODELS, f"l{uuid.uuid4().hex[:8]}",
                       CONVEYOR_HTTP_PORT=str(port), CONVEYOR_GRPC_PORT=str(free_port()), **env)
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

# --- HTTP timeouts -------------------------------------------------------------------------

HEADER_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 2.0
KEEPALIVE_S = 0.3
MARGIN_S = 3.0
"""Slack for a busy host: a timeout fires within its setting plus this."""


@pytest.fixture(scope="module")
def timed_api(redis_server: RedisServer, logdir: Path) -> Iterator[int]:
    proc, port = start_serve(redis_server, logdir, "timed",
                             CONVEYOR_HTTP_HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S),
                             CONVEYOR_HTTP_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S),
                             CONVEYOR_HTTP_KEEPALIVE_S=str(KEEPALIVE_S))
    wait_live(proc, f"http://127.0.0.1:{port}")
    yield port
    proc.stop()


def test_http_listens_on_loopback_only_by_default(timed_api: int) -> None:
    assert listening_hosts(timed_api) == {"127.0.0.1"}


def test_trickled_headers_are_cut_off_at_the_header_timeout(timed_api: int) -> None:
    with connect(timed_api) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n")
        took = trickle_until_closed(sock, b"X-Slow: 1\r\n", 0.5, HEADER_TIMEOUT_S + MARGIN_S)
    assert took >= HEADER_TIMEOUT_S - 0.6


def test_the_header_timeout_restarts_after_each_response(timed_api: int) -> None:
    """Every byte resets the keep-alive timer; the header timer still runs from the answer."""
    with connect(timed_api) as sock:
        sock.sendall(LIVE)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        took = trickle_until_closed(sock, b"X-Slow: 1\r\n", 0.1, HEADER_TIMEOUT_S + MARGIN_S)
    assert took >= HEADER_TIMEOUT_S - 0.6


def test_idle_keepalive_connections_are_closed(timed_api: int) -> None:
    with connect(timed_api) as sock:
        sock.sendall(LIVE)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        sock.sendall(LIVE)  # a second request on the same connection is served
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        while not closed(sock):
            assert time.monotonic() - answered < HEADER_TIMEOUT_S - 0.5, "idle connection kept"


def test_a_slow_body_gets_408(timed_api: int) -> None:
    with connect(timed_api) as sock:
        sock.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        started = time.monotonic()
        answer = b""
        while not answer:
            assert time.monotonic() - started < BODY_TIMEOUT_S + MARGIN_S, "no 408"
            sock.sendall(b" ")
            time.sleep(0.2)
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                continue
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"error"' in answer and b"connection: close" in answer.lower()
    assert time.monotonic() - started >= BODY_TIMEOUT_S - 0.6


def test_a_complete_body_in_time_is_not_cut(timed_api: int) -> None:
    response = httpx.post(f"http://127.0.0.1:{timed_api}/v2/repository/index", json={})
    assert response.status_code != 408


# --- HTTP connection and header limits -----------------------------------------------------

MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def limited_api(redis_server: RedisServer, logdir: Path) -> Iterator[int]:
    proc, port = start_serve(redis_server, logdir, "limited",
                             CONVEYOR_HTTP_MAX_CONNECTIONS=str(MAX_CONNECTIONS))
    wait_live(proc, f"http://127.0.0.1:{port}")
    yield port
    proc.stop()


def test_connections_beyond_the_limit_are_closed_at_once(limited_api: int) -> None:
    time.sleep(0.5)  # earlier connections (the fixture's probes) are gone by now
    held = [connect(limited_api) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # each is open and served, so each holds a slot
            sock.sendall(LIVE)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
        extra = connect(limited_api)
        with extra:
            wait_for(lambda: closed(extra), 5, "the connection over the limit to be closed")
        held[0].sendall(LIVE)  # those within the limit are still served
        assert read_response(held[0]).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{limited_api}/v2/health/live",
                               timeout=2).status_code == 200, 10, "a free connection slot")


def test_oversized_request_headers_get_431(limited_api: int) -> None:
    padding = b"a" * (MAX_HEADER_BYTES + 1)
    with connect(limited_api) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nX-Big: " + padding + b"\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 431")
    response = httpx.get(f"http://127.0.0.1:{limited_api}/v2/health/live",
                         headers={"X-Fine": "a" * 1000})
    assert response.status_code == 200


# --- TLS -----------------------------------------------------------------------------------


def test_https_with_the_configured_certificate_and_no_plain_http(
        redis_server: RedisServer, logdir: Path, tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "server")
    proc, port = start_serve(redis_server, logdir, "tls", CONVEYOR_TLS_CERT_FILE=str(cert),
                             CONVEYOR_TLS_KEY_FILE=str(key))
    trusted = ssl.create_default_context(cafile=str(cert))
    try:
        wait_live(proc, f"https://127.0.0.1:{port}", verify=trusted)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v2/health/live")
        with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
            httpx.get(f"https://127.0.0.1:{port}/v2/health/live")
    finally:
        proc.stop()


def test_uvicorn_config_requires_client_certificates_with_a_client_ca(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "server")
    client_cert, _ = make_cert(tmp_path, "client")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        """Never called: only the configuration is inspected."""

    mutual = config(Settings(tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=client_cert),
                    app)
    assert (mutual.ssl_certfile, mutual.ssl_keyfile) == (cert, key)
    assert mutual.ssl_ca_certs == client_cert and mutual.ssl_cert_reqs == ssl.CERT_REQUIRED
    plain = config(Settings(), app)
    assert not plain.is_ssl and plain.access_log is False
    assert issubclass(plain.http, GuardedHttpProtocol)  # type: ignore[arg-type]
    assert plain.http.limits == ConnectionLimits(5.0, 10.0, 30.0, 2048)  # type: ignore[union-attr]


# --- gRPC ----------------------------------------------------------------------------------
# The endpoint runs in a child process (tests/grpc_listener_probe.py, or the whole API) and
# the calls carry raw bytes: api.proto's ``inference.*`` symbols cannot share this process's
# descriptor pool with tritonclient's, which other test modules import.

GRPC_LIMIT = 64 * 1024
LIVE_METHOD = "/inference.GRPCInferenceService/ServerLive"
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
LIVE_REPLY = b"\x08\x01"
"""ServerLiveResponse(live=True) on the wire."""


def grpc_env(port: int, **overrides: str) -> dict[str, str]:
    return {**os.environ, "CONVEYOR_GRPC_PORT": str(port),
            "CONVEYOR_MAX_REQUEST_BYTES": str(GRPC_LIMIT), **overrides}


@contextlib.contextmanager
def grpc_probe(port: int, **env: str) -> Iterator[dict[str, Any]]:
    """The probe's first line; it serves (when it could bind) until the block ends."""
    child = subprocess.Popen([sys.executable, "-m", "tests.grpc_listener_probe"], cwd=ROOT,
                             env=grpc_env(port, **env), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    try:
        line = child.stdout.readline()
        if not line:
            raise AssertionError(f"the gRPC probe died: {child.stderr.read()}")
        yield cast(dict[str, Any], json.loads(line))
    finally:
        child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)
        child.stdout.close()
        child.stderr.close()


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def infer_request(model: str, raw: bytes) -> bytes:
    """ModelInferRequest(model_name=model, raw_input_contents=[raw]) on the wire."""
    name = model.encode()
    return b"\x0a" + varint(len(name)) + name + b"\x3a" + varint(len(raw)) + raw


def live(channel: grpc.Channel) -> bool:
    return bool(channel.unary_unary(LIVE_METHOD)(b"", timeout=10) == LIVE_REPLY)


def test_grpc_listens_on_the_configured_host_only() -> None:
    port = free_port()
    with grpc_probe(port) as first:
        assert first == {"serving": True}
        assert listening_hosts(port) in ({"127.0.0.1"}, {"::ffff:127.0.0.1"})


def test_grpc_messages_over_the_limit_are_resource_exhausted() -> None:
    port = free_port()
    with grpc_probe(port) as first, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert first == {"serving": True}
        assert live(channel)
        big = infer_request("echo", b"\0" * (GRPC_LIMIT + 1))
        with pytest.raises(grpc.RpcError) as error:
            channel.unary_unary(INFER_METHOD)(big, timeout=10)
    assert cast(grpc.Call, error.value).code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_grpc_options_bound_messages_streams_and_idle_connections() -> None:
    options = dict(grpc_listener.server_options(Settings(max_request_bytes=1000)))
    assert options["grpc.max_receive_message_length"] == 1000
    assert options["grpc.max_send_message_length"] == 1000
    assert options["grpc.so_reuseport"] == 0
    assert options["grpc.max_concurrent_streams"] > 0
    assert options["grpc.max_connection_idle_ms"] > 0
    assert dict(grpc_listener.server_options(Settings(grpc_reuseport=True)))["grpc.so_reuseport"] == 1
    assert grpc_listener.address("::1", 8001) == "[::1]:8001"
    assert grpc_listener.address("[::1]", 8001) == "[::1]:8001"
    assert grpc_listener.address("127.0.0.1", 8001) == "127.0.0.1:8001"


def test_a_grpc_port_in_use_is_a_startup_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with grpc_probe(taken.getsockname()[1]) as first:
            assert "in use" in first.get("bind_error", ""), first


def test_the_api_exits_when_its_grpc_port_is_in_use(redis_server: RedisServer) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = service_env(redis_server.url, TEST_MODELS, f"l{uuid.uuid4().hex[:8]}",
                          CONVEYOR_HTTP_PORT=str(free_port()),
                          CONVEYOR_GRPC_PORT=str(taken.getsockname()[1]))
        done = subprocess.run([sys.executable, "-m", "api.serve"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == STARTUP_FAILURE, done.stderr
    assert "the port is in use" in done.stderr


def test_grpc_port_is_shared_only_when_both_servers_allow_it() -> None:
    """Another stack holding the port with SO_REUSEPORT: an error unless we opt in too."""
    port = free_port()
    with grpc_probe(port, CONVEYOR_GRPC_REUSEPORT="1") as first:
        assert first == {"serving": True}
        with grpc_probe(port) as refused:
            assert "bind_error" in refused, refused
        with grpc_probe(port, CONVEYOR_GRPC_REUSEPORT="1") as second:
            assert second == {"serving": True}


def test_grpc_tls_and_client_certificates(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "server")
    client_cert, client_key = make_cert(tmp_path, "client")
    port = free_port()
    target = f"localhost:{port}"
    with_client = grpc.ssl_channel_credentials(cert.read_bytes(), client_key.read_bytes(),
                                               client_cert.read_bytes())

    def reachable(channel: grpc.Channel) -> bool:
        with channel:
            try:
                return live(channel)
            except grpc.RpcError:
                return False

    with grpc_probe(port, CONVEYOR_TLS_CERT_FILE=str(cert), CONVEYOR_TLS_KEY_FILE=str(key),
                    CONVEYOR_TLS_CLIENT_CA_FILE=str(client_cert)) as first:
        assert first == {"serving": True}
        assert [
            reachable(grpc.secure_channel(target, with_client)),
            reachable(grpc.secure_channel(target, grpc.ssl_channel_credentials(cert.read_bytes()))),
            reachable(grpc.insecure_channel(target)),
        ] == [True, False, False]


# --- Worker probe --------------------------------------------------------------------------


@pytest.mark.parametrize(("host", "bound"), [("127.0.0.1", "127.0.0.1"), ("::1", "::1")])
def test_the_worker_probe_binds_the_configured_host(host: str, bound: str) -> None:
    server = start_probe(cast(Supervisor, None), host, 0)
    try:
        assert server.server_address[0] == bound
    finally:
        server.shutdown()
        server.server_close()
