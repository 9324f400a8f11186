"""A lean Redis client for the hot path: RESP2 encoding, pipelining, deferred replies.

redis-py spends 60-80 µs of Python per command on our 2-core benchmark box (connection
pool, retry wrapper, argument normalisation, response callbacks); a request crosses
Redis four times, so that alone was a third of a tiny model's latency. Here a command
is one ``bytes`` join and its reply one ``hiredis`` parse: about 15 µs a command
(docs/data-path.md section 7). Only the per-request commands use it; every
other Redis call stays on redis-py.

:class:`Connection` is the blocking client of an inference process. Its :meth:`send`
writes commands now and reads their replies later, before the next command's (or at
:meth:`Connection.flush`): a worker answers a batch and goes straight back to reading
without waiting a round trip.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import hiredis

from batching.urls import mask_url

log = logging.getLogger(__name__)

Arg = bytes | str | int | float
Command = Sequence[Arg]
ReplyHandler = Callable[[list[Any]], None]


class RespError(Exception):
    """Redis answered a command with an error reply (``NOGROUP ...``, ``NOSCRIPT ...``)."""


def encode(command: Command) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(command)]
    for arg in command:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        else:
            data = repr(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def encode_all(commands: Sequence[Command]) -> bytes:
    return b"".join(encode(c) for c in commands)


def new_reader() -> Any:
    """A hiredis reader that returns error replies as :class:`RespError` values."""
    return hiredis.Reader(replyError=RespError)


CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL,
             "none": ssl.CERT_NONE}
CERT_REQS_NAMES = {**{name: name for name in CERT_REQS},
                   **{f"CERT_{name.upper()}": name for name in CERT_REQS}}
"""``ssl_cert_reqs`` values redis-py and Celery accept, to the short name."""
FALSE = frozenset({"0", "F", "FALSE", "N", "NO"})
"""What redis-py reads as false in a URL's query."""


@dataclass(frozen=True, slots=True)
class Address:
    """Where Redis listens and how to log in, from a ``redis://``, ``rediss://`` or
    ``unix://`` URL (the forms redis-py accepts)."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_verify: str = "required"
    """``ssl_cert_reqs`` of the URL, as redis-py reads it: required, optional or none."""
    ca_certs: str | None = None
    """``ssl_ca_certs`` of the URL: a CA bundle to trust instead of the system's."""
    certfile: str | None = None
    """``ssl_certfile``: the client certificate (PEM) presented to Redis (mutual TLS)."""
    keyfile: str | None = None
    """``ssl_keyfile``: the client certificate's key; None: in ``certfile``."""
    check_hostname: bool = True
    """``ssl_check_hostname``: the server certificate must name the host (when verified)."""

    @classmethod
    def from_url(cls, url: str) -> Address:
        parsed = urlparse(url)
        if parsed.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"unsupported Redis URL scheme {parsed.scheme!r}: {mask_url(url)}")
        query = parse_qs(parsed.query)
        def one(name: str) -> str | None:
            return next(iter(query.get(name, [])), None)
        db_text = one("db") or parsed.path.lstrip("/") or "0"
        if parsed.scheme == "unix":
            db_text = one("db") or "0"
        return cls(host=parsed.hostname or "127.0.0.1", port=parsed.port or 6379,
                   path=parsed.path if parsed.scheme == "unix" else None, db=int(db_text),
                   username=unquote(parsed.username) if parsed.username else None,
                   password=unquote(parsed.password) if parsed.password else None,
                   tls=parsed.scheme == "rediss",
                   tls_verify=CERT_REQS_NAMES.get(one("ssl_cert_reqs") or "required", "?"),
                   ca_certs=one("ssl_ca_certs"), certfile=one("ssl_certfile"),
                   keyfile=one("ssl_keyfile"),
                   check_hostname=(one("ssl_check_hostname") or "true").upper() not in FALSE)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of a ``rediss://`` URL; None for plain connections."""
        if not self.tls:
            return None
        verify_mode = self._cert_reqs()
        context = ssl.create_default_context(cafile=self.ca_certs)
        if self.certfile:
            context.load_cert_chain(self.certfile, self.keyfile)
        context.check_hostname = self.check_hostname and verify_mode == ssl.CERT_REQUIRED
        context.verify_mode = verify_mode
        return context

    def ssl_options(self) -> dict[str, Any] | None:
        """The TLS options of a ``rediss://`` URL as redis-py's connection keywords, which
        are also what Celery's ``broker_use_ssl`` and ``redis_backend_use_ssl`` take;
        None for plain connections."""
        if not self.tls:
            return None
        return {"ssl_cert_reqs": self._cert_reqs(), "ssl_ca_certs": self.ca_certs,
                "ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile,
                "ssl_check_hostname": self.check_hostname}

    def _cert_reqs(self) -> ssl.VerifyMode:
        if self.tls_verify not in CERT_REQS:
            raise ValueError("ssl_cert_reqs must be required, optional or none")
        return CERT_REQS[self.tls_verify]

    def login(self) -> list[Command]:
        """Commands to send first on a new connection: AUTH and SELECT, as needed."""
        commands: list[Command] = []
        if self.password is not None:
            commands.append(("AUTH", self.username, self.password) if self.username
                            else ("AUTH", self.password))
        if self.db:
            commands.append(("SELECT", self.db))
        return commands


TRANSIENT = ("LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN")
"""Error replies of a Redis that is starting or failing over: retried like a lost
connection, not raised as a refusal."""


def check(reply: Any) -> Any:
    """``reply``, unless it is an error reply: then raise it (a transient one as
    ``ConnectionError``)."""
    if isinstance(reply, RespError):
        if str(reply).startswith(TRANSIENT):
            raise ConnectionError(f"Redis is not serving yet: {reply}")
        raise reply
    return reply


class Connection:
    """One blocking connection, opened on first use and again after any failure.

    Socket errors and timeouts surface as ``OSError``; error replies to :meth:`execute`
    raise :class:`RespError`.
    """

    def __init__(self, address: Address, timeout_s: float, connect_timeout_s: float = 1.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None
        self._reader: Any = None
        self._poller = select.poll()
        self._deferred: list[tuple[int, ReplyHandler | None]] = []

    def send(self, commands: Sequence[Command], on_replies: ReplyHandler | None = None) -> None:
        """Write ``commands`` now; their replies are read before the next command's and
        handed to ``on_replies`` (error replies are logged when nobody takes them)."""
        sock = self._connected()
        try:
            sock.sendall(encode_all(commands))
        except OSError:
            self.close()
            raise
        self._deferred.append((len(commands), on_replies))

    def execute(self, commands: Sequence[Command], spin_s: float = 0.0) -> list[Any]:
        """Send ``commands`` in one write and return their replies, in order."""
        self.send(commands)
        count, _ = self._deferred.pop()
        self._drain()
        if spin_s > 0 and not self._reader.has_data():
            self._spin(spin_s)
        replies = self._replies(count)
        for reply in replies:
            check(reply)
        return replies

    def call(self, *command: Arg) -> Any:
        return self.execute([command])[0]

    def flush(self) -> None:
        """Read every outstanding deferred reply."""
        self._drain()

    def close(self) -> None:
        self._deferred.clear()
        if self._sock is not None:
            self._sock.close()
        self._sock = None

    def _drain(self) -> None:
        while self._deferred:
            count, handler = self._deferred.pop(0)
            replies = self._replies(count)
            if handler is not None:
                handler(replies)
            else:
                for reply in replies:
                    if isinstance(reply, RespError):
                        log.error("Redis refused a deferred command: %s", reply)

    def _spin(self, spin_s: float) -> None:
        """Wait for the reply by polling, not sleeping, for up to ``spin_s``."""
        poller = self._poller
        deadline = time.perf_counter() + spin_s
        while not poller.poll(0) and time.perf_counter() < deadline:
            os.sched_yield()

    def _replies(self, count: int) -> list[Any]:
        sock = self._sock
        assert sock is not None
        replies: list[Any] = []
        try:
            while len(replies) < count:
                reply = self._reader.gets()
                if reply is False:
                    data = sock.recv(1 << 16)
                    if not data:
                        raise ConnectionError("Redis closed the connection")
                    self._reader.feed(data)
                    continue
                replies.append(reply)
        except (OSError, hiredis.ProtocolError) as exc:
            self.close()
            if isinstance(exc, OSError):
                raise
            raise ConnectionError(f"bad reply from Redis: {exc}") from exc
        return replies

    def _connected(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        address = self.address
        sock: socket.socket
        if address.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.connect_timeout_s)
            sock.connect(address.path)
        else:
            sock = socket.create_connection((address.host, address.port),
                                            timeout=self.connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            context = address.ssl_context()
            if context is not None:
                sock = context.wrap_socket(sock, server_hostname=address.host)
        sock.settimeout(self.timeout_s)
        self._sock, self._reader = sock, new_reader()
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._deferred.clear()
        login = address.login()
        if login:
            try:
                self.execute(login)
            except RespError:
                self.close()
                raise
        return sock
