"""Bytes endpoints (api/bytes_endpoint.py) started on loopback for a test, plain or TLS,
and closed after it."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from api.bytes_endpoint import BytesEndpoint
from tests.test_listeners import make_cert


@contextmanager
def running_endpoint(tls: ssl.SSLContext | None = None) -> Iterator[BytesEndpoint]:
    """A bytes endpoint on loopback, speaking TLS with ``tls`` if given."""
    started = BytesEndpoint("127.0.0.1", tls=tls)
    started.start()
    try:
        yield started
    finally:
        started.close()


@contextmanager
def tls_endpoint(folder: Path) -> Iterator[tuple[BytesEndpoint, Path]]:
    """A bytes endpoint on loopback that speaks TLS only, with a certificate made in
    ``folder``; and that certificate, for the clients to trust."""
    cert, key = make_cert(folder, "api")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    with running_endpoint(tls) as started:
        yield started, cert
