"""The large outputs inference processes upload to this API process's bytes endpoint
(batching/output_refs.py has the protocol): each request's upload is offered at its
admission (:meth:`Uploads.offer`), taken on the endpoint's threads only for the holder of
its token, within its deadline, once, and up to its bound, and held until the reply that
names it is resolved (:meth:`Uploads.take`) or the request is over (:meth:`Uploads.free`).
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from batching.output_refs import (
    HEAD,
    ITEM,
    MAX_ITEMS,
    STATUS,
    TOKEN_BYTES,
    UPLOAD_MAGIC,
    Offer,
    UploadRefusal,
)

TOKENS_DRAWN = 256
"""Tokens' worth of random bytes taken from the OS at once."""
OFFER_S = 10.0
"""An upload's items must all arrive within this long of its head (before any token is
checked, a trickle must not hold the connection's thread)."""


@dataclass(slots=True)
class _Slot:
    token: bytes
    expiry_ms: int
    bound: int
    open: bool = True
    """No upload accepted yet (a reference is single-use)."""
    parts: list[bytes] | None = None
    """The tensors uploaded, once all were received."""


@dataclass(slots=True)
class _Accepted:
    ids: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    """Per accepted item, in order: the id it goes to and its length."""
    expiry_ms: int = 0
    """The latest deadline of the requests accepted: their bytes are of no use after."""


class Uploads:
    """The upload places of one API process's requests in flight, shared by its event loop
    (offer, take, free) and its bytes endpoint's threads (accept, store)."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self._slots: dict[int, _Slot] = {}
        self._ids = itertools.count(1)
        self._entropy = memoryview(b"")
        self._lock = threading.Lock()

    def offer(self, where: str, bound: int, expiry_ms: int) -> Offer:
        """A place for up to ``bound`` bytes of one request's outputs until ``expiry_ms``,
        uploaded to the bytes endpoint at ``where``."""
        if len(self._entropy) < TOKEN_BYTES:
            self._entropy = memoryview(secrets.token_bytes(TOKEN_BYTES * TOKENS_DRAWN))
        token, self._entropy = bytes(self._entropy[:TOKEN_BYTES]), self._entropy[TOKEN_BYTES:]
        rid = next(self._ids)
        with self._lock:
            self._slots[rid] = _Slot(token, expiry_ms, bound)
        return Offer(where, rid, bound, expiry_ms, token, self.min_bytes)

    def take(self, rid: int) -> list[bytes] | None:
        """The tensors uploaded to ``rid`` (its place given up), or None if none were."""
        with self._lock:
            slot = self._slots.pop(rid, None)
        return None if slot is None else slot.parts

    def free(self, rid: int) -> None:
        with self._lock:
            self._slots.pop(rid, None)

    def __len__(self) -> int:
        return len(self._slots)

    def accept(self, items: list[tuple[int, bytes, int]]) -> tuple[list[int], _Accepted]:
        """Each item's status (0 or a negative refusal) and the items accepted: an id's
        items all or none, each id's place closed to any later upload."""
        now_ms = time.time() * 1000.0
        totals: dict[int, int] = {}
        for rid, _, length in items:
            totals[rid] = totals.get(rid, 0) + length
        verdict: dict[int, int] = {}
        expiries: dict[int, int] = {}
        with self._lock:
            for rid, token, _ in items:
                if rid not in verdict:
                    verdict[rid] = self._verdict(rid, token, totals[rid], now_ms)
                    if verdict[rid] == 0:
                        expiries[rid] = self._slots[rid].expiry_ms
        accepted = _Accepted()
        for rid, _, length in items:
            if verdict[rid] == 0:
                accepted.ids.append(rid)
                accepted.lengths.append(length)
                accepted.expiry_ms = max(accepted.expiry_ms, expiries[rid])
        return [verdict[rid] for rid, _, _ in items], accepted

    def _verdict(self, rid: int, token: bytes, total: int, now_ms: float) -> int:
        slot = self._slots.get(rid)
        if slot is None:
            return -UploadRefusal.GONE
        if not hmac.compare_digest(slot.token, token):
            return -UploadRefusal.TOKEN
        if slot.expiry_ms < now_ms:
            return -UploadRefusal.EXPIRED
        if not slot.open:
            return -UploadRefusal.USED
        if total > slot.bound:
            return -UploadRefusal.TOO_LARGE
        slot.open = False
        return 0

    def store(self, accepted: _Accepted, parts: list[bytes]) -> None:
        """The accepted items' bytes received: held by id, for the reply to name."""
        by_id: dict[int, list[bytes]] = {}
        for rid, part in zip(accepted.ids, parts, strict=True):
            by_id.setdefault(rid, []).append(part)
        with self._lock:
            for rid, got in by_id.items():
                slot = self._slots.get(rid)
                if slot is not None:  # else the request ended meanwhile
                    slot.parts = got

    def receive(self, sock: socket.socket, count: int) -> bool:
        """One upload on ``sock`` of ``count`` items, its ``CVU1`` head already read:
        answered, its accepted bytes stored (api/bytes_endpoint.py calls it); whether any
        was accepted. Its items
        must arrive within ``OFFER_S``, its bytes before the latest deadline of the
        requests they are for; else :class:`TimeoutError`."""
        if count > MAX_ITEMS:
            raise ValueError("an upload of too many tensors")
        stall = sock.gettimeout()
        try:
            answer, accepted = self._offered(sock, count, stall)
            sock.sendall(answer)
            if not accepted.ids:
                return False
            until = time.monotonic() + accepted.expiry_ms / 1000.0 - time.time()
            body = _recv_exactly(sock, sum(accepted.lengths), until, stall)
        finally:
            sock.settimeout(stall)
        parts, at = [], 0
        for length in accepted.lengths:
            parts.append(bytes(body[at:at + length]))  # what the answer's encoders take
            at += length
        self.store(accepted, parts)
        sock.sendall(HEAD.pack(UPLOAD_MAGIC, len(parts)))
        return True

    def _offered(self, sock: socket.socket, count: int, stall: float | None
                 ) -> tuple[bytes, _Accepted]:
        """The answer to an upload's ``count`` items and those accepted: nothing else of
        them outlives the call (the items parsed take some 220 bytes each, 0.9 MB for
        ``MAX_ITEMS``: a peer that sends them and reads no answer must not hold that)."""
        body = _recv_exactly(sock, ITEM.size * count, time.monotonic() + OFFER_S, stall)
        statuses, accepted = self.accept(list(ITEM.iter_unpack(body)))
        return UPLOAD_MAGIC + b"".join(STATUS.pack(s) for s in statuses), accepted


def _recv_exactly(sock: socket.socket, size: int, until: float, stall: float | None
                  ) -> memoryview:
    """``size`` bytes, received in place into one buffer (not zeroed first: every byte is
    received into it) by ``until`` (monotonic), each read within ``stall``."""
    view = np.empty(size, np.uint8).data
    got = 0
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while got < size:
        left = until - time.monotonic()
        if left <= 0:
            raise TimeoutError("an upload that did not arrive in time")
        sock.settimeout(left if stall is None else min(left, stall))
        n = sock.recv_into(view[got:], size - got, flags)
        if n == 0:
            raise ConnectionError("the inference process closed the connection mid-upload")
        got += n
    return view
