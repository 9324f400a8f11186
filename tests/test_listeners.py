"""Listeners: bind address, TLS and gRPC limits (the HTTP timeouts and connection guards are
in tests/test_listener_timeouts.py).

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
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import pytest
from uvicorn.config import STARTUP_FAILURE

from api import grpc_listener
from api.http_guard import ConnectionLimits, GuardedHttpProtocol
from api.serve import EXIT_REFUSED, config
from batching.exposure import is_loopback, unsafe_binding
from batching.settings import Settings
from tests.conftest import TEST_MODELS
from tests.listener_harness import listening_hosts, start_serve, wait_live
from tests.procs import ROOT, RedisServer, free_port, service_env
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


def make_cert(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key

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
