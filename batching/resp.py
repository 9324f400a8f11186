"""The lean Redis client of the hot path: RESP2 encoding, pipelining, deferred replies.

redis-py spends 60-80 µs of Python per command on our 2-core benchmark box (connection
pool, retry wrapper, argument normalisation, response callbacks); a request crosses
Redis four times, so that alone was a third of a tiny model's latency. Here a command
is one ``bytes`` join and its reply one ``hiredis`` parse: about 15 µs a command
(docs/data-path.md section 7; ``python -m bench.lean_redis`` measures it again). Only
the per-request commands use it; every other Redis call stays on redis-py, and
``CONVEYOR_LEAN_REDIS=0`` puts these on redis-py too (batching.redis_links).

:class:`Connection` is the blocking client of an inference process. Its :meth:`send`
writes commands now and reads their replies later, before the next command's (or at
:meth:`Connection.flush`): a worker answers a batch and goes straight back to reading
without waiting a round trip. :class:`Link` is the API's: an asyncio protocol that
hands each reply to the callback written with its command, straight from
``data_received``. Both read their URL with redis-py's parser (:class:`Address`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import hiredis
from redis.asyncio.connection import RedisSSLContext, parse_url

from batching.urls import mask_url

log = logging.getLogger(__name__)

Arg = bytes | str | int | float
Command = Sequence[Arg]
ReplyHandler = Callable[[list[Any]], None]
"""Called with the replies of the commands of one :meth:`Connection.send`."""
LinkHandler = Callable[[Any], None]
"""Called with one command's reply, a :class:`RespError`, or the ``ConnectionError`` of a
lost link."""


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
"""The ``ssl_cert_reqs`` values redis-py accepts."""
SSL_CONTEXT_OPTIONS = frozenset({
    "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_include_verify_flags",
    "ssl_exclude_verify_flags", "ssl_ca_certs", "ssl_ca_data", "ssl_ca_path",
    "ssl_check_hostname", "ssl_min_version", "ssl_ciphers", "ssl_password"})
"""The ``ssl_*`` options redis.asyncio's TLS connections take; others are refused, as
redis.asyncio refuses them."""


@dataclass(frozen=True, slots=True)
class Address:
    """Where Redis listens, how to log in and the TLS options, from a ``redis://``,
    ``rediss://`` or ``unix://`` URL as redis-py reads it."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_options: tuple[tuple[str, Any], ...] = ()
    """The URL's ``ssl_*`` query options, as redis-py's parser typed them, by name."""

    @classmethod
    def from_url(cls, url: str) -> Address:
        """Parsed by redis-py's own URL parser, so the lean clients and redis-py read every
        URL, and every option in it, alike."""
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"unsupported Redis URL scheme {scheme!r}: {mask_url(url)}")
        kwargs = parse_url(url)
        tls_options = sorted((k, v) for k, v in kwargs.items() if k.startswith("ssl_"))
        return cls(host=kwargs.get("host", "127.0.0.1"), port=kwargs.get("port", 6379),
                   path=kwargs.get("path"), db=kwargs.get("db", 0),
                   username=kwargs.get("username"), password=kwargs.get("password"),
                   tls=scheme == "rediss", tls_options=tuple(tls_options))

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of a ``rediss://`` URL, built by redis-py's own builder from the
        URL's options; None for plain connections."""
        if not self.tls:
            return None
        options = self._ssl_options()
        unknown = sorted(options.keys() - SSL_CONTEXT_OPTIONS)
        if unknown:
            raise ValueError(f"unsupported TLS option {unknown[0]} in the Redis URL")
        context: ssl.SSLContext = RedisSSLContext(
            **{name.removeprefix("ssl_"): value for name, value in options.items()}).get()
        return context

    def ssl_options(self) -> dict[str, Any] | None:
        """The TLS options of a ``rediss://`` URL as redis-py's connection keywords, which
        are also what Celery's ``broker_use_ssl`` and ``redis_backend_use_ssl`` take;
        None for plain connections."""
        if not self.tls:
            return None
        options = self._ssl_options()
        return {**options, "ssl_cert_reqs": CERT_REQS[options["ssl_cert_reqs"]]}

    def _ssl_options(self) -> dict[str, Any]:
        """The URL's ``ssl_*`` options over redis-py's defaults for a TLS connection."""
        options = {"ssl_cert_reqs": "required", "ssl_ca_certs": None, "ssl_certfile": None,
                   "ssl_keyfile": None, "ssl_check_hostname": True, **dict(self.tls_options)}
        if options["ssl_cert_reqs"] not in CERT_REQS:
            raise ValueError("ssl_cert_reqs must be required, optional or none")
        return options

    def login(self) -> list[Command]:
        """Commands to send first on a new connection: AUTH and SELECT, as needed."""
        commands: list[Command] = []
        if self.password is not None:
            commands.append(("AUTH", self.username, self.password) if self.username
                            else ("AUTH", self.password))
        if self.db:
            commands.append(("SELECT", self.db))
        return commands


TRANSIENT = ("LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")
"""Error replies of a Redis that is starting or failing over (a cluster too): retried like
a lost connection, not raised as a refusal."""
DEMOTED = "READONLY"
"""The error reply of a replica to a write: the node this link reached is no primary (any
more, after a failover). The link is dropped as if lost, so its owner reconnects to the
primary the sentinels name now."""


def demoted(reply: Any) -> bool:
    return isinstance(reply, RespError) and str(reply).startswith(DEMOTED)


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

    splits = False
    """One server applies the commands of a write in their order (a cluster's client,
    :mod:`batching.resp_cluster`, splits them)."""

    def __init__(self, address: Address, timeout_s: float, connect_timeout_s: float = 1.0,
                 locate: Callable[[], Address] | None = None) -> None:
        """``locate``: asked for the primary's address before each connection (Sentinel);
        the connection then checks with ``ROLE`` that it reached a primary."""
        self.address = address
        self.locate = locate
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
        """Send ``commands`` in one write and return their replies, in order; an error
        reply raises."""
        replies = self.exchange(commands, spin_s)
        for reply in replies:
            check(reply)
        return replies

    def exchange(self, commands: Sequence[Command], spin_s: float = 0.0) -> list[Any]:
        """:meth:`execute`, error replies returned as :class:`RespError` values."""
        self.send(commands)
        count, _ = self._deferred.pop()
        self._drain()
        if spin_s > 0 and not self._reader.has_data():
            self._spin(spin_s)
        return self._replies(count)

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
        if any(demoted(reply) for reply in replies):
            self.close()
            raise ConnectionError(f"Redis at {self.address.host}:{self.address.port} is a "
                                  "replica now")
        return replies

    def _connected(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        if self.locate is not None:
            self.address = self.locate()
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
        if self.locate is not None:
            login.append(("ROLE",))
        if login:
            try:
                replies = self.execute(login)
            except RespError:
                self.close()
                raise
            if self.locate is not None and not is_primary(replies[-1]):
                self.close()
                raise ConnectionError(f"Redis at {address.host}:{address.port} is no primary")
        return sock


class Link(asyncio.Protocol):
    """One asyncio connection: each reply goes to the handler written with its command,
    first in, first out, from ``data_received``: no task switch, no connection pool."""

    def __init__(self) -> None:
        self._reader: Any = new_reader()
        self._handlers: deque[LinkHandler] = deque()
        self._transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while True:
            try:
                reply = self._reader.gets()
            except Exception as exc:  # hiredis.ProtocolError: nothing more can be trusted
                self.abort()
                self.connection_lost(exc)
                return
            if reply is False:
                return
            if demoted(reply):  # every later reply would say the same: reconnect
                self.abort()
                self.connection_lost(ConnectionError(str(reply)))
                return
            self._handlers.popleft()(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        error = ConnectionError(f"lost the connection to Redis{f': {exc}' if exc else ''}")
        while self._handlers:
            self._handlers.popleft()(error)
        if not self.closed.done():
            self.closed.set_result(None)

    @property
    def open(self) -> bool:
        return self._transport is not None

    def prepare(self, commands: Sequence[Command]) -> bytes:
        """``commands`` in the form :meth:`write` takes: encoded, once for a command sent
        again and again."""
        return encode_all(commands)

    def write(self, data: bytes, handlers: list[LinkHandler]) -> None:
        """Send encoded commands; ``handlers`` (one per command) receive their replies."""
        if self._transport is None:
            error = ConnectionError("not connected to Redis")
            for handler in handlers:
                handler(error)
            return
        self._handlers.extend(handlers)
        self._transport.write(data)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    async def execute(self, *commands: Command) -> list[Any]:
        """Send ``commands`` and await their replies; error replies raise."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in commands]
        self.write(encode_all(commands), [resolver(f) for f in futures])
        return [check(reply) for reply in await asyncio.gather(*futures)]


def resolver(future: asyncio.Future[Any]) -> LinkHandler:
    """A handler that settles ``future`` with the reply, or with a lost link's error."""
    def resolve(reply: Any) -> None:
        if future.done():
            return
        if isinstance(reply, OSError):
            future.set_exception(reply)
        else:
            future.set_result(reply)
    return resolve


def is_primary(role: Any) -> bool:
    """Whether a ``ROLE`` reply is a primary's."""
    return isinstance(role, list) and bool(role) and role[0] == b"master"


async def open_link(address: Address, timeout_s: float = 1.0, primary: bool = False) -> Link:
    """Connect, log in (AUTH, SELECT), see Redis answer a ``PING`` and return the link;
    raises ``OSError`` or :class:`RespError`. ``primary``: check with ``ROLE`` that the
    node is a primary (one the sentinels named), else raise ``ConnectionError``.

    The ``PING`` matters under TLS 1.3: a Redis that refuses the client's certificate
    (or has none to ask for) drops the connection only after the handshake, so without
    a reply the link would count as open and its owner reconnect at once, again and
    again, instead of backing off.
    """
    loop = asyncio.get_running_loop()
    if address.path is not None:
        connecting = loop.create_unix_connection(Link, address.path)
    else:
        connecting = loop.create_connection(Link, address.host, address.port,
                                            ssl=address.ssl_context())
    _, link = await asyncio.wait_for(connecting, timeout_s)
    check_role: list[Command] = [("ROLE",)] if primary else []
    try:
        replies = await asyncio.wait_for(
            link.execute(*address.login(), ("PING",), *check_role), timeout_s)
    except (OSError, RespError, TimeoutError):
        link.abort()
        raise
    if primary and not is_primary(replies[-1]):
        link.abort()
        raise ConnectionError(f"Redis at {address.host}:{address.port} is no primary")
    return link
