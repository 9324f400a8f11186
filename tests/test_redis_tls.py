"""rediss:// with client certificates, against a real redis-server that demands them.

Certificates come from openssl; redis-server listens on a TLS port only, with
``tls-auth-clients yes``. The URL carries the options as redis-py spells them
(``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``; ``ssl_cert_reqs`` defaults to
required), and every client conveyor has must connect with it: the hot path's
connections, lean (blocking and asyncio) or on redis-py (``CONVEYOR_LEAN_REDIS=0``),
redis-py, and Celery's broker and result backend.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from api.dispatch import Admission, Dispatcher
from batching.envelope import Reply, Request, Tensor
from batching.errors import Unavailable
from batching.keys import Keys
from batching.redis_links import blocking_link
from batching.resp import Address, open_link
from tests.procs import ROOT, free_port, wait_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certificates(folder: Path) -> None:
    """ca.pem, server.pem/key (127.0.0.1, localhost) and client.pem/key, signed by ca."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=folder)
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, extra in (("server", ["-extfile", "server.ext"]), ("client", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", *extra, cwd=folder)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    folder = tmp_path_factory.mktemp("tls")
    _certificates(folder)
    port = free_port()
    log = (folder / "redis.log").open("wb")
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", "server.pem", "--tls-key-file", "server.key",
         "--tls-ca-cert-file", "ca.pem", "--tls-auth-clients", "yes", "--save", "",
         "--appendonly", "no"], cwd=folder, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: b"Ready to accept connections" in (folder / "redis.log").read_bytes(),
                 20, "redis-server with TLS")
        yield port, folder
    finally:
        server.terminate()
        server.wait(10)
        log.close()


def url(port: int, folder: Path, client_cert: bool = True) -> str:
    query = f"ssl_ca_certs={folder / 'ca.pem'}"
    if client_cert:
        query += f"&ssl_certfile={folder / 'client.pem'}&ssl_keyfile={folder / 'client.key'}"
    return f"rediss://127.0.0.1:{port}/0?{query}"


async def client_reset(dispatcher: Dispatcher, admission: Admission) -> None:
    """Empty the stream and the reply list of a failed attempt."""
    await dispatcher.redis.delete(admission.stream, admission.rows_key, dispatcher.reply_key)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "redis-py"])
def test_the_worker_s_connection_presents_the_client_certificate(
        tls_redis: tuple[int, Path], lean: bool) -> None:
    port, folder = tls_redis
    connection = blocking_link(url(port, folder), 5, lean)
    try:
        assert connection.execute([("ECHO", "x")]) == [b"x"]
    finally:
        connection.close()
    refused = blocking_link(url(port, folder, client_cert=False), 5, lean)
    with pytest.raises(OSError):
        refused.execute([("ECHO", "x")])
    refused.close()


def test_the_lean_asyncio_link_presents_it_too(tls_redis: tuple[int, Path]) -> None:
    port, folder = tls_redis

    async def ping() -> list[object]:
        link = await open_link(Address.from_url(url(port, folder)), timeout_s=5)
        try:
            return await link.execute(("PING",))
        finally:
            link.abort()

    assert asyncio.run(ping())[0] in (b"PONG", "PONG")


async def queued(dispatcher: Dispatcher, stream: str) -> int:
    """The stream's length; 0 when the dispatcher's client (0.5 s to connect) times out
    handshaking on a busy host: the caller asks again."""
    try:
        return int(await dispatcher.redis.xlen(stream))
    except redis.exceptions.TimeoutError:
        return 0


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "redis-py"])
def test_the_dispatcher_admits_and_pops_over_tls(tls_redis: tuple[int, Path], lean: bool) -> None:
    """Admission and reply pops, on either client, with the URL's client certificate.
    Without it Redis drops each connection once the handshake is done (TLS 1.3): the
    dispatcher must not count such a link as open (and reconnect in a tight loop)."""
    port, folder = tls_redis
    keys = Keys(f"tls-{lean}")

    async def main() -> None:
        dispatcher = Dispatcher(url(port, folder), keys, lean=lean)
        refused = Dispatcher(url(port, folder, client_cert=False), keys, lean=lean)
        await dispatcher.start()
        await refused.start()
        try:
            for _ in range(500):
                if dispatcher._writer is not None:
                    break
                await asyncio.sleep(0.01)
            x = Tensor.from_array("x", np.zeros((1, 2), np.float32))
            admission = Admission(keys.queue("m", 1), keys.rows_waiting("m"), 1, 10)
            for attempt in range(3):  # a throttled host once lost the link mid-test: retry,
                sent = Request(dispatcher.new_id(), dispatcher.reply_key, 0, 0, 1, [x])
                waiting = asyncio.ensure_future(dispatcher.submit(admission, sent, 5))
                while not await queued(dispatcher, admission.stream) and not waiting.done():
                    await asyncio.sleep(0.01)
                await dispatcher.redis.rpush(dispatcher.reply_key, Reply(sent.id).encode())
                try:
                    assert (await waiting).id == sent.id  # as a client retries a 503
                    break
                except Unavailable:
                    if attempt == 2:
                        raise
                    await client_reset(dispatcher, admission)
            assert refused._writer is None and not refused.redis_ok
            other = Request(refused.new_id(), refused.reply_key, 0, 0, 1, [x])
            with pytest.raises(Unavailable):
                await refused.submit(admission, other, 5)
        finally:
            await dispatcher.close()
            await refused.close()
    asyncio.run(main())


def test_redis_py_reads_the_same_url(tls_redis: tuple[int, Path]) -> None:
    port, folder = tls_redis
    client = redis.Redis.from_url(url(port, folder))
    try:
        assert client.ping()
    finally:
        client.close()


def test_celery_broker_and_backend_connect_with_the_urls_certificates(
        tls_redis: tuple[int, Path]) -> None:
    """Without ``broker_use_ssl``/``redis_backend_use_ssl`` from the URL, Celery's backend
    refuses a rediss:// URL lacking ``ssl_cert_reqs`` outright."""
    port, folder = tls_redis
    script = ("from workers.app import app\n"
              "app.connection_for_write().ensure_connection(max_retries=1)\n"
              "assert app.backend.client.ping()\n"
              "print('both connected')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=90,
                          env={**os.environ, "CONVEYOR_REDIS_URL": url(port, folder),
                               "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "both connected" in done.stdout


def test_ssl_options_follow_the_url() -> None:
    assert Address.from_url("redis://cache").ssl_options() is None
    options = Address.from_url("rediss://cache?ssl_certfile=/c.pem&ssl_keyfile=/c.key"
                               "&ssl_cert_reqs=optional&ssl_check_hostname=false"
                               "&ssl_ciphers=HIGH").ssl_options()
    assert options == {"ssl_cert_reqs": ssl.CERT_OPTIONAL, "ssl_ca_certs": None,
                       "ssl_certfile": "/c.pem", "ssl_keyfile": "/c.key",
                       "ssl_check_hostname": False, "ssl_ciphers": "HIGH"}
    with pytest.raises(ValueError, match="ssl_cert_reqs"):
        Address.from_url("rediss://cache?ssl_cert_reqs=sometimes").ssl_context()
