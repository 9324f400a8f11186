"""A batch's large outputs uploaded to the API processes that hold their requests
(batching/output_refs.py has the protocol), so that the Redis replies carry only where
they are. Whatever cannot be uploaded (the API process unreachable, the upload refused,
cut short) stays in the reply, so every request is still answered once."""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass

from batching.envelope import Reply, Tensor
from batching.former import Entry
from batching.output_refs import (
    HEAD,
    ITEM,
    MAX_ITEMS,
    OFFER,
    STATUS,
    UPLOAD_MAGIC,
    Offer,
    UploadRefusal,
    output_ref,
    parse_offer,
)
from batching.settings import Settings
from batching.tensor_transport import client_context, send_parts

log = logging.getLogger(__name__)

KEEP_LINKS = 64
"""Connections kept, the least recently used closed beyond."""


@dataclass(slots=True)
class _Upload:
    offer: Offer
    tensors: list[Tensor]


class OutputPush:
    """One inference process's uploads: one kept connection per bytes endpoint, each
    upload within ``timeout_s`` (``CONVEYOR_TENSOR_FETCH_TIMEOUT_S``; TLS checked against
    ``CONVEYOR_TENSOR_FETCH_CA_FILE``). An endpoint that could not be reached, or whose
    upload failed (an API process that accepts connections but stalls would otherwise hold
    every batch's answer for ``timeout_s``), is not tried again for ``timeout_s``: its
    outputs stay in the replies meanwhile."""

    def __init__(self, timeout_s: float | None = None, tls: ssl.SSLContext | None = None
                 ) -> None:
        self._timeout_s = timeout_s
        self._tls = tls
        self._links: dict[str, socket.socket] = {}
        self._down: dict[str, float] = {}
        """Endpoints that could not be reached: until when (monotonic)."""
        self._taking: set[str] = set()
        """Endpoints that stored an upload since they were last unreachable (logged once)."""

    def push(self, answered: Sequence[tuple[Entry, Reply]]) -> None:
        """Upload the large outputs of the ``answered`` requests that offer a place for
        them; each one stored is replaced in its reply by its reference."""
        by_endpoint: dict[str, list[_Upload]] = {}
        for entry, reply in answered:
            offer = parse_offer(entry.request.params.get(OFFER)) if reply.ok else None
            if offer is None:
                continue
            large = [t for t in reply.outputs if t.ref is None and len(t.raw) >= offer.min_bytes]
            if large:  # beyond its bound, the endpoint refuses it
                by_endpoint.setdefault(offer.where, []).append(_Upload(offer, large))
        for where, uploads in by_endpoint.items():
            chunk: list[_Upload] = []
            for upload in uploads:  # MAX_ITEMS tensors an upload at most
                if chunk and sum(len(u.tensors) for u in chunk) + len(upload.tensors) > MAX_ITEMS:
                    self._upload(where, chunk)
                    chunk = []
                chunk.append(upload)
            self._upload(where, chunk)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()

    def _upload(self, where: str, uploads: list[_Upload]) -> None:
        """One endpoint's share: its stored uploads' tensors made references."""
        if self._down.get(where, 0.0) > time.monotonic():
            return
        if self._timeout_s is None:
            settings = Settings()
            self._timeout_s = settings.tensor_fetch_timeout_s
            self._tls = client_context(settings.tensor_fetch_ca_file)
        items = [(u, t) for u in uploads for t in u.tensors]
        deadline = time.monotonic() + self._timeout_s
        while True:
            kept = where in self._links
            try:
                link = self._link(where, deadline)
            except (OSError, ValueError) as exc:
                self._down[where] = time.monotonic() + self._timeout_s
                self._taking.discard(where)
                log.warning("large outputs go through Redis for %.1f s: the API process at "
                            "%s cannot be reached: %s", self._timeout_s, where, exc)
                return
            try:
                link.settimeout(max(deadline - time.monotonic(), 0.001))
                stored, refused = _exchange(link, items)
                break
            except (OSError, ValueError) as exc:
                self._links.pop(where, None)
                link.close()
                if not (kept and isinstance(exc, ConnectionError)):
                    self._down[where] = time.monotonic() + self._timeout_s
                    self._taking.discard(where)
                    log.warning("large outputs go through Redis for %.1f s: the upload of "
                                "%d requests' outputs to %s failed: %s", self._timeout_s,
                                len(uploads), where, exc)
                    return
        if stored and where not in self._taking:
            self._taking.add(where)
            log.info("large outputs go to the API process at %s by reference", where)
        if UploadRefusal.TOO_LARGE in refused:
            log.warning("large outputs go through Redis: more bytes than their requests' "
                        "declared outputs hold were refused by %s", where)
        for upload in uploads:
            if upload.offer.id in stored:
                for index, tensor in enumerate(upload.tensors):
                    tensor.ref, tensor.raw = output_ref(upload.offer.id, index,
                                                        len(tensor.raw)), b""

    def _link(self, where: str, deadline: float) -> socket.socket:
        link = self._links.pop(where, None)
        if link is None:
            link = _connect(where, max(deadline - time.monotonic(), 0.001), self._tls)
        self._links[where] = link  # the newest used: the last to be let go
        while len(self._links) > KEEP_LINKS:
            self._links.pop(next(iter(self._links))).close()
        return link


def _connect(where: str, timeout_s: float, tls: ssl.SSLContext | None) -> socket.socket:
    scheme, _, address = where.partition("://")
    host, _, port = address.rpartition(":")
    raw = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if scheme != "tls":
        return raw
    try:
        return (tls or client_context(None)).wrap_socket(raw, server_hostname=host.strip("[]"))
    except BaseException:
        raw.close()
        raise


def _exchange(link: socket.socket, items: list[tuple[_Upload, Tensor]]
              ) -> tuple[set[int], set[int]]:
    """One upload of ``items`` on ``link``: the ids whose tensors the endpoint stored, and
    the refusals it answered."""
    link.sendall(HEAD.pack(UPLOAD_MAGIC, len(items)) + b"".join(
        ITEM.pack(u.offer.id, u.offer.token, len(t.raw)) for u, t in items))
    answer = _recv(link, len(UPLOAD_MAGIC) + STATUS.size * len(items))
    if answer[:len(UPLOAD_MAGIC)] != UPLOAD_MAGIC:
        raise ValueError("not a bytes endpoint's answer")
    statuses = [STATUS.unpack_from(answer, len(UPLOAD_MAGIC) + STATUS.size * i)[0]
                for i in range(len(items))]
    refused = {-status for status in statuses if status < 0}
    accepted = [t.raw for (_, t), status in zip(items, statuses, strict=True) if status == 0]
    if not accepted:
        return set(), refused
    send_parts(link, accepted)
    magic, count = HEAD.unpack(_recv(link, HEAD.size))
    if magic != UPLOAD_MAGIC or count != len(accepted):
        raise ValueError("the endpoint stored another count of tensors")
    return {u.offer.id for (u, _), status in zip(items, statuses, strict=True)
            if status == 0}, refused


def _recv(link: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = link.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the endpoint closed the connection")
        got += n
    return bytes(data)

