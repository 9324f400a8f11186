"""Large input tensors fetched from their API process instead of passing through Redis,
where the inference processes run on another host (the tensor arena needs a shared
``/dev/shm``: batching/tensor_arena.py).

Pull, not push: the API process keeps a large input's bytes for as long as the request
is in flight (api/bytes_endpoint.py) and the stream entry carries a reference to them,
``[where, id, length, expiry_ms, token]``: ``where`` is ``tcp://host:port`` (or
``tls://``) of that process's bytes endpoint, ``token`` 16 random bytes made for this
tensor alone, ``expiry_ms`` the request's deadline (ms since the epoch), after which the
endpoint refuses it. An inference process fetches the inputs of everything it read in
one round trip per API process (:class:`FetchClient`), every endpoint at once.

The protocol, over one kept-alive TCP connection per endpoint, TLS when the API speaks it:

- request: ``CVF1``, a ``u32`` count *n*, then *n* times (``u64`` id, 16-byte token);
- reply: ``CVF1``, *n* ``i64``: a tensor's length, or a negative :class:`Refusal`, then
  the bytes of the tensors served, in order.

Everything little-endian. docs/data-path.md has the measurements against Arrow Flight.
"""

from __future__ import annotations

import enum
import socket
import ssl
import struct
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from batching.tensor_arena import TensorGone

MAGIC = b"CVF1"
COUNT = struct.Struct("<4sI")
ITEM = struct.Struct("<Q16s")
LENGTH = struct.Struct("<q")
TOKEN_BYTES = 16
MAX_ITEMS = 4096
"""Most references in one fetch; a larger request is a protocol error."""
KEEP_LINKS = 64
"""Connections a fetch client keeps, the least recently used closed beyond."""
POOL_THREADS = 8
"""Threads a fetch client asks endpoints beyond the first on."""
SENDMSG_PARTS = 512
"""Buffers handed to one ``sendmsg`` at most (the kernel's IOV_MAX is 1024)."""

Ref = list[Any]
"""``[where, id, length, expiry_ms, token]``, as it travels in a request envelope."""


class Refusal(enum.IntEnum):
    """Why the endpoint serves no bytes for a reference (sent negated)."""

    GONE = 1
    """Unknown id: the request is over for its API process (answered, timed out, its
    client gone), or that process restarted."""
    TOKEN = 2
    """The token is not the one made for this tensor."""
    EXPIRED = 3
    """Past the reference's expiry."""


REASONS = {
    Refusal.GONE: "the API process that admitted the request no longer holds its input "
                  "(it gave the request up, or restarted)",
    Refusal.TOKEN: "the API process refused the input's token",
    Refusal.EXPIRED: "the request's input expired with its deadline",
}


def is_remote(ref: Ref) -> bool:
    """``ref`` is a reference to an API process's bytes endpoint (not to an arena)."""
    return len(ref) == 5


class Parsed(NamedTuple):
    where: str
    id: int
    length: int
    expiry_ms: int
    token: bytes


def parse(ref: Ref) -> Parsed:
    """The reference's fields, checked; :class:`TensorGone` if it is malformed."""
    try:
        where, rid, length, expiry, token = ref
        parsed = Parsed(str(where), int(rid), int(length), int(expiry), bytes(token))
    except (TypeError, ValueError):
        raise TensorGone(f"malformed tensor reference {ref!r}") from None
    if (parsed.length < 0 or len(parsed.token) != TOKEN_BYTES or parsed.id < 0
            or not parsed.where.startswith(("tcp://", "tls://"))):
        raise TensorGone(f"malformed tensor reference {ref!r}")
    return parsed


def encode_request(items: Sequence[tuple[int, bytes]]) -> bytes:
    """One fetch of ``(id, token)`` pairs."""
    return struct.pack(f"<4sI{'Q16s' * len(items)}", MAGIC, len(items),
                       *[field for item in items for field in item])


KERNEL_TIMEOUTS = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
"""What a blocking socket raises when ``SO_RCVTIMEO`` or ``SO_SNDTIMEO`` runs out."""


def arm(link: socket.socket, deadline: float, send: bool = False) -> None:
    """Bound ``link``'s next blocking receive (and with ``send`` its sends) by ``deadline``
    (monotonic), in the kernel: a fetch's socket blocks, so that one ``recv`` with
    ``MSG_WAITALL`` takes a whole reply, where a socket with a Python timeout polls before
    each ``recv`` and takes what has arrived (a dozen wake-ups for a batch of images)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    seconds = int(left)
    value = struct.pack("@ll", seconds, max(1, int((left - seconds) * 1e6)))
    link.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    if send:
        link.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def client_context(ca_file: Path | None) -> ssl.SSLContext:
    """How an inference process checks an endpoint that speaks TLS: against ``ca_file``,
    or the system's CAs."""
    return ssl.create_default_context(cafile=str(ca_file) if ca_file else None)


def send_parts(link: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """``parts`` in as few ``sendmsg`` calls as the kernel takes them; one ``sendall`` each
    over TLS (an ``ssl.SSLSocket`` has no ``sendmsg``). The bytes endpoint's replies and an
    inference process's uploads both go this way."""
    if isinstance(link, ssl.SSLSocket):
        for part in parts:
            link.sendall(part)
        return
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = link.sendmsg(views[:SENDMSG_PARTS])
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


class FetchClient:
    """An inference process's fetches, one kept connection per endpoint, all the endpoints
    of one fetch at once (the first on the calling thread, the others on threads of the
    client's own), each within ``timeout_s``. An endpoint that could not be reached is
    not tried again for ``timeout_s``: its inputs fail at once meanwhile, so that a host
    cut off stalls one fetch, not each."""

    def __init__(self, timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        self._timeout_s = timeout_s
        self._tls = tls
        self._links: dict[str, socket.socket] = {}
        self._down: dict[str, tuple[float, str]] = {}
        """Endpoints that could not be reached: until when (monotonic), and why."""
        self._pool: ThreadPoolExecutor | None = None

    def fetch(self, refs: Sequence[Ref]) -> list[memoryview | TensorGone]:
        """Each reference's bytes, or why they cannot be had."""
        out: list[memoryview | TensorGone] = [TensorGone("not fetched")] * len(refs)
        groups: dict[str, list[tuple[int, Parsed]]] = {}
        for index, ref in enumerate(refs):
            try:
                parsed = parse(ref)
            except TensorGone as exc:
                out[index] = exc
                continue
            groups.setdefault(parsed.where, []).append((index, parsed))
        deadline = time.monotonic() + self._timeout_s
        jobs = list(groups.items())
        if len(jobs) > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="conveyor-fetch")
        others = [(g, self._pool.submit(self._one, w, g, deadline))
                  for w, g in jobs[1:]] if self._pool is not None else []
        done = [(g, self._one(w, g, deadline)) for w, g in jobs[:1]]
        done += [(g, f.result()) for g, f in others]  # each ends by its sockets' timeouts
        for group, got in done:
            for (index, _), one in zip(group, got, strict=True):
                out[index] = one
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for link in self._links.values():
            link.close()
        self._links.clear()

    def _one(self, where: str, group: list[tuple[int, Parsed]],
             deadline: float) -> list[memoryview | TensorGone]:
        """One endpoint's share of a fetch, within ``deadline``: asked again once on a new
        connection when the kept one turns out closed (its API process restarted)."""
        down = self._down.get(where)
        if down is not None and down[0] > time.monotonic():
            return self._failed(where, group, down[1])
        while True:
            kept = where in self._links
            try:
                link = self._link(where, deadline)
            except (OSError, ValueError) as exc:
                self._down[where] = (time.monotonic() + self._timeout_s, str(exc))
                return self._failed(where, group, str(exc))
            self._down.pop(where, None)
            try:
                arm(link, deadline, send=True)
                link.sendall(encode_request([(p.id, p.token) for _, p in group]))
                return _read_reply(link, [p.length for _, p in group], deadline)
            except (OSError, ValueError) as exc:
                self._links.pop(where, None)
                link.close()
                if not (kept and isinstance(exc, ConnectionError)):
                    why = "timed out" if isinstance(exc, KERNEL_TIMEOUTS) else str(exc)
                    return self._failed(where, group, why)

    def _link(self, where: str, deadline: float) -> socket.socket:
        link = self._links.pop(where, None)
        if link is not None:
            self._links[where] = link  # the newest used: the last to be let go
            return link
        scheme, _, address = where.partition("://")
        host, _, port = address.rpartition(":")
        raw = socket.create_connection((host.strip("[]"), int(port)),
                                       timeout=max(deadline - time.monotonic(), 0.001))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if scheme == "tls":
            try:
                raw = (self._tls or client_context(None)).wrap_socket(
                    raw, server_hostname=host.strip("[]"))
            except BaseException:
                raw.close()
                raise
        raw.settimeout(None)  # blocking: each fetch bounds itself in the kernel (arm)
        self._links[where] = raw
        while len(self._links) > KEEP_LINKS:  # endpoints of API processes long gone
            self._links.pop(next(iter(self._links))).close()
        return raw

    @staticmethod
    def _failed(where: str, group: list[tuple[int, Parsed]], why: str) -> list[
            memoryview | TensorGone]:
        return [TensorGone(f"the request's input could not be fetched from its API process "
                           f"at {where}: {why}") for _ in group]


def _read_reply(link: socket.socket, lengths: list[int],
                deadline: float) -> list[memoryview | TensorGone]:
    """One fetch's reply, within ``deadline``: each tensor's bytes (views of one buffer),
    or why not."""
    head = _recv_into(link, memoryview(bytearray(len(MAGIC) + LENGTH.size * len(lengths))),
                      deadline)
    if head[:len(MAGIC)] != MAGIC:
        raise ValueError("not a bytes endpoint's reply")
    sizes: tuple[int, ...] = struct.unpack_from(f"<{len(lengths)}q", head, len(MAGIC))
    if sizes != tuple(lengths) and any(
            size >= 0 and size != expected for size, expected in zip(sizes, lengths, strict=True)):
        raise ValueError("the endpoint sent a tensor of another length")
    arm(link, deadline)
    # Not zeroed first: every byte is received into it.
    body = _recv_into(link, np.empty(sum(s for s in sizes if s > 0), np.uint8).data, deadline)
    got: list[memoryview | TensorGone] = []
    at = 0
    for size in sizes:
        if size < 0:
            got.append(TensorGone(_reason(-size)))
            continue
        got.append(body[at:at + size])
        at += size
    return got


def _recv_into(link: socket.socket, view: memoryview, deadline: float) -> memoryview:
    """``view`` filled from ``link`` by ``deadline`` (its receive bounded by :func:`arm`): over TCP
    in one ``recv`` unless the kernel's bound cut it short."""
    got, size = 0, len(view)
    tls = isinstance(link, ssl.SSLSocket)
    flags = 0 if tls else socket.MSG_WAITALL
    while got < size:
        n = link.recv_into(view[got:], size - got, flags)
        if n == 0:
            raise ConnectionError("the endpoint closed the connection")
        got += n
        if got < size and (not tls or time.monotonic() >= deadline):
            arm(link, deadline)  # past the deadline: TimeoutError
    return view


def _reason(code: int) -> str:
    try:
        return REASONS[Refusal(code)]
    except ValueError:
        return f"the API process refused the input (code {code})"
