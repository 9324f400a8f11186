"""The API process's bytes endpoint: the large inputs of its requests in flight, served to
the inference processes of other hosts that hold a reference made for them
(batching/tensor_transport.py has the protocol and the reference).

A tensor is held from :meth:`BytesEndpoint.put` until :meth:`BytesEndpoint.free` (its
request answered, timed out or withdrawn), and never served past its expiry. The endpoint
binds ``CONVEYOR_HOST`` as the API's other listeners do, on the first free port from
``CONVEYOR_TENSOR_FETCH_PORT`` (0: any), and speaks TLS when the API does.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import itertools
import logging
import secrets
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from batching.output_refs import UPLOAD_MAGIC
from batching.settings import Settings
from batching.tensor_transport import (
    COUNT,
    ITEM,
    LENGTH,
    MAGIC,
    MAX_ITEMS,
    TOKEN_BYTES,
    Ref,
    Refusal,
    send_parts,
)

log = logging.getLogger(__name__)

PORTS_TRIED = 256
"""With a fixed first port, how many ports from it are tried (one per API process)."""
POLL_S = 0.1
"""How often the accepting thread looks whether it is to stop."""
TOKENS_DRAWN = 256
"""Tokens' worth of random bytes taken from the OS at once: one call each cost the API
about 2% of its CPU at 1,800 requests a second."""
MAX_CONNECTIONS = 1024
"""Connections one endpoint holds at most (a thread each); more are closed at once."""
STALL_S = 10.0
"""The longest a connection may stall inside a fetch (its TLS handshake, the rest of a
request begun, taking the reply), or wait before its first fetch or upload holding a
valid reference: then it is closed."""
IDLE_S = 600.0
"""The longest a connection that has presented a valid reference may wait between two
fetches: then it is closed (an inference process connects again when it next fetches)."""


@dataclass(slots=True)
class _Held:
    data: bytes | memoryview
    expiry_ms: int
    token: bytes


class BytesEndpoint:
    """Holds tensors by id and serves them to the holders of their token, from threads of
    its own (one per connection, blocking ``sendmsg`` of the held bytes, no copy): the
    API's event loop only puts and frees."""

    def __init__(self, host: str, port: int = 0, *, advertise: str = "",
                 tls: ssl.SSLContext | None = None) -> None:
        self._host = host
        self._port = port
        self._advertise = advertise
        self.tls = tls
        self._held: dict[int, _Held] = {}
        self._ids = itertools.count(1)
        self._entropy = memoryview(b"")
        """Random bytes drawn ahead, the next tokens (one draw per ``TOKENS_DRAWN``)."""
        self._server: _Server | None = None
        self.where = ""
        """``tcp://host:port`` or ``tls://host:port``, as references carry it; set by
        :meth:`start`."""
        self.on_upload: Callable[[socket.socket, int], bool] | None = None
        """What takes an upload of large outputs (api/output_upload.py), its head read:
        whether it accepted any."""

    @property
    def started(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        self._server = self._listen()
        port = self._server.server_address[1]
        host = self._advertise or self._host
        if ":" in host:
            host = f"[{host}]"
        self.where = f"{'tls' if self.tls else 'tcp'}://{host}:{port}"
        threading.Thread(target=self._server.serve_forever, args=(POLL_S,),
                         name="conveyor-bytes-endpoint",
                         daemon=True).start()
        log.info("large inputs to inference processes of other hosts are served at %s",
                 self.where)

    def _listen(self) -> _Server:
        port = self._port
        while True:
            try:
                return _Server(self, (self._host, port))
            except OSError as exc:
                last = min(self._port + PORTS_TRIED - 1, 65535)
                if exc.errno != errno.EADDRINUSE or port in (0, last):
                    raise
                port += 1

    def put(self, data: bytes | memoryview, expiry_ms: int) -> Ref:
        """Hold ``data`` (not copied unless it may change) until :meth:`free`; its
        reference."""
        if isinstance(data, memoryview) and not data.readonly:
            data = bytes(data)
        rid = next(self._ids)
        if len(self._entropy) < TOKEN_BYTES:
            self._entropy = memoryview(secrets.token_bytes(TOKEN_BYTES * TOKENS_DRAWN))
        token, self._entropy = bytes(self._entropy[:TOKEN_BYTES]), self._entropy[TOKEN_BYTES:]
        self._held[rid] = _Held(data, expiry_ms, token)
        return [self.where, rid, len(data), expiry_ms, token]

    def free(self, ref: Ref) -> None:
        self._held.pop(ref[1], None)

    def serve(self, items: list[tuple[int, bytes]]) -> list[bytes | memoryview]:
        """The reply to one fetch: its header, then the bytes of each tensor served."""
        now_ms = time.time() * 1000.0
        sizes: list[int] = []
        parts: list[bytes | memoryview] = []
        for rid, token in items:
            held = self._held.get(rid)
            if held is None:
                sizes.append(-Refusal.GONE)
            elif not hmac.compare_digest(held.token, token):
                sizes.append(-Refusal.TOKEN)
            elif held.expiry_ms < now_ms:
                sizes.append(-Refusal.EXPIRED)
            else:
                sizes.append(len(held.data))
                parts.append(held.data)
        head = MAGIC + b"".join(LENGTH.pack(s) for s in sizes)
        return [head, *parts]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.close_connections()
            self._server = None
        self._held.clear()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, endpoint: BytesEndpoint, address: tuple[str, int]) -> None:
        self.endpoint = endpoint
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._open: dict[socket.socket, bool] = {}
        """The connections open, oldest first, and whether each has shown a valid
        reference."""
        self._lock = threading.Lock()
        super().__init__(address, _Connection)

    def prove(self, sock: socket.socket) -> None:
        """``sock`` has shown a valid reference: a new connection no longer displaces it."""
        with self._lock:
            if sock in self._open:
                self._open[sock] = True

    def get_request(self) -> tuple[socket.socket, Any]:
        """A new connection; with the table full it displaces the oldest that has shown
        no valid reference, or is closed at once when every one has."""
        sock, peer = self.socket.accept()
        with self._lock:
            full = len(self._open) >= MAX_CONNECTIONS
            if full:
                unproven = next((s for s, proven in self._open.items() if not proven), None)
                if unproven is not None:
                    del self._open[unproven]
                    with contextlib.suppress(OSError):
                        unproven.shutdown(socket.SHUT_RDWR)
                    full = False
            if not full:
                self._open[sock] = False
        if full:
            sock.close()
            log.warning("bytes endpoint: refused a connection from %s: %d open already",
                        peer, MAX_CONNECTIONS)
            raise OSError("too many connections")  # socketserver drops the request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(STALL_S)
        return sock, peer

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._open.clear()


class _Connection(socketserver.BaseRequestHandler):
    """One inference process's connection: its fetches answered in order."""

    server: _Server

    def handle(self) -> None:
        """Until the connection presents a valid reference it may not wait between
        messages beyond ``STALL_S``, and a fetch holding none closes it once answered: a
        peer without references cannot hold the endpoint's connections."""
        endpoint = self.server.endpoint
        sock: socket.socket = self.request
        proven = False
        try:
            if endpoint.tls is not None:
                sock = endpoint.tls.wrap_socket(sock, server_side=True)
            while True:
                fetch = _read_fetch(sock, self._upload if endpoint.on_upload else None,
                                    IDLE_S if proven else 0.0)
                if fetch is None:
                    return
                items, uploaded = fetch
                proven = proven or uploaded
                parts = endpoint.serve(items)
                served = len(parts) > 1  # a valid reference among its items
                if served and not proven:
                    self.server.prove(self.request)  # before the peer has its answer
                send_parts(sock, parts)
                if not (proven or served):
                    return
                proven = proven or served
        except (OSError, ValueError) as exc:
            log.debug("bytes endpoint: a connection ended: %s", exc)
        finally:
            if sock is not self.request:
                sock.close()

    def _upload(self, sock: socket.socket, count: int) -> bool:
        """An upload taken by the endpoint's ``on_upload``; one accepted proves the
        connection."""
        on_upload = self.server.endpoint.on_upload
        accepted = on_upload is not None and on_upload(sock, count)
        if accepted:
            self.server.prove(self.request)
        return accepted


def _read_fetch(sock: socket.socket, on_upload: Callable[[socket.socket, int], bool] | None,
                idle_s: float) -> tuple[list[tuple[int, bytes]], bool] | None:
    """The next fetch on ``sock`` (waited for up to ``idle_s``, or ``STALL_S`` if more;
    once begun, each read of it within ``STALL_S``) and whether an upload before it was
    accepted; None when the peer closed it between fetches. An upload of outputs
    (batching/output_refs.py) goes to ``on_upload`` whole."""
    uploaded = False
    while True:
        head = _recv_exactly(sock, COUNT.size, idle_s=idle_s)
        if head is None:
            return None
        magic, count = COUNT.unpack(head)
        if magic != UPLOAD_MAGIC or on_upload is None:
            break
        uploaded = on_upload(sock, count) or uploaded
        if uploaded:
            idle_s = IDLE_S
    if magic != MAGIC or count > MAX_ITEMS:
        raise ValueError("a connection that does not speak the bytes endpoint's protocol")
    body = _recv_exactly(sock, ITEM.size * count)
    if body is None:
        raise ValueError("a fetch cut short")
    return [ITEM.unpack_from(body, ITEM.size * i) for i in range(count)], uploaded


def _recv_exactly(sock: socket.socket, size: int, idle_s: float = 0.0) -> bytes | None:
    """``size`` bytes; None if the peer closed first. ``idle_s``: before the first byte
    the socket's timeout only means nothing came yet, for that long."""
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    idle_until = time.monotonic() + idle_s
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            if got == 0 and time.monotonic() < idle_until:
                continue
            raise
        if n == 0:
            return None
        got += n
    return bytes(data)


def advertised_host(host: str, redis_url: str) -> str:
    """The address other hosts reach this process at, for a bind address ``host``: itself,
    unless it names every interface; then this host's address on the way to Redis (the
    network the inference processes share with it)."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    target = urlsplit(redis_url.split(",")[0]).hostname or "127.0.0.1"
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, 9))  # UDP: no packet is sent
            address: str = probe.getsockname()[0]
        except OSError:
            return socket.gethostname()
    return address


def endpoint_from(settings: Settings) -> BytesEndpoint | None:
    """The bytes endpoint ``settings`` ask for: on ``host`` as the API's listeners, with
    TLS when they speak it; None when large inputs go through Redis."""
    if settings.tensor_transport == "redis":
        return None
    tls = None
    if settings.tls_cert_file is not None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    return BytesEndpoint(settings.host, settings.tensor_fetch_port, tls=tls,
                         advertise=settings.tensor_fetch_host
                         or advertised_host(settings.host, settings.redis_url))
