"""Hostile and broken uploads to the bytes endpoint (api/output_upload.py): a trickle holds
no connection past its bound (the items within ``OFFER_S``, the bytes within the
requests' deadlines), a declared length beyond any bound is refused before a byte of it is
read, an upload cut short stores nothing and leaves the endpoint serving, and uploads on
many threads beside the event loop's offers and frees each store their own bytes."""

from __future__ import annotations

import os
import socket
import threading
import time
import tracemalloc
from typing import cast

import pytest

import api.output_upload
from api.bytes_endpoint import BytesEndpoint
from api.output_upload import Uploads
from batching.output_refs import (
    HEAD,
    ITEM,
    MAX_ITEMS,
    STATUS,
    UPLOAD_MAGIC,
    Offer,
    UploadRefusal,
)

PATIENCE_S = 30.0
"""How long a test waits for the endpoint to act: far past any bound it tests."""


def _uploads(endpoint: BytesEndpoint) -> Uploads:
    uploads = Uploads(1024)
    endpoint.on_upload = uploads.receive
    return uploads


def _connect(endpoint: BytesEndpoint) -> socket.socket:
    host, port = endpoint.where.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=PATIENCE_S)


def _recv(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the endpoint closed the connection"
        data += chunk
    return data


def _offer_items(sock: socket.socket, items: list[tuple[Offer, int]]) -> list[int]:
    """The first step of an upload: the endpoint's status for each item."""
    sock.sendall(HEAD.pack(UPLOAD_MAGIC, len(items))
                 + b"".join(ITEM.pack(o.id, o.token, n) for o, n in items))
    answer = _recv(sock, len(UPLOAD_MAGIC) + STATUS.size * len(items))
    assert answer[:4] == UPLOAD_MAGIC
    return [STATUS.unpack_from(answer, 4 + STATUS.size * i)[0] for i in range(len(items))]


def _trickle_until_closed(sock: socket.socket, byte: bytes) -> float:
    """Send ``byte`` every 50 ms until the endpoint closes ``sock``: the seconds it took."""
    sock.settimeout(0.05)
    started = time.monotonic()
    while time.monotonic() - started < PATIENCE_S:
        try:
            sock.sendall(byte)
            if sock.recv(64) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:  # reset or broken pipe: closed
            return time.monotonic() - started
    raise AssertionError("a trickling upload kept its connection")


def test_a_trickle_of_accepted_bytes_is_cut_at_the_requests_deadline(
        endpoint: BytesEndpoint) -> None:
    uploads = _uploads(endpoint)
    offer = uploads.offer(endpoint.where, 1 << 20, int(time.time() * 1000) + 500)
    sock = _connect(endpoint)
    assert _offer_items(sock, [(offer, 1 << 20)]) == [0]
    # Each byte comes well within the endpoint's stall limit; the whole never would.
    _trickle_until_closed(sock, b"x")
    sock.close()
    assert uploads.take(offer.id) is None  # nothing stored, the place given up once taken
    assert len(uploads) == 0


def test_a_trickle_of_items_is_cut_before_any_token_is_checked(
        endpoint: BytesEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api.output_upload, "OFFER_S", 0.5)
    _uploads(endpoint)
    sock = _connect(endpoint)
    sock.sendall(HEAD.pack(UPLOAD_MAGIC, 4096))
    _trickle_until_closed(sock, b"\0")
    sock.close()


def test_a_length_past_any_bound_is_refused_unread_and_the_connection_goes_on(
        endpoint: BytesEndpoint) -> None:
    uploads = _uploads(endpoint)
    later = int(time.time() * 1000) + 60_000
    offer = uploads.offer(endpoint.where, 100, later)
    other = uploads.offer(endpoint.where, 100, later)
    sock = _connect(endpoint)
    assert _offer_items(sock, [(offer, (1 << 64) - 1)]) == [-UploadRefusal.TOO_LARGE]
    # Two items of one id whose lengths only together pass its bound: refused as one.
    assert _offer_items(sock, [(offer, 60), (offer, 60)]) == [-UploadRefusal.TOO_LARGE] * 2
    assert _offer_items(sock, [(other, 3), (offer, 2)]) == [0, 0]
    sock.sendall(b"abcde")
    assert HEAD.unpack(_recv(sock, HEAD.size)) == (UPLOAD_MAGIC, 2)
    sock.close()
    assert uploads.take(other.id) == [b"abc"] and uploads.take(offer.id) == [b"de"]


class _Silent:
    """A peer that sent ``data`` and reads no answer: the memory the endpoint holds, traced,
    at each answer it sends (where a real peer that does not read would hold it)."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self.held: list[int] = []

    def gettimeout(self) -> float:
        return 10.0

    def settimeout(self, timeout: float | None) -> None:
        pass

    def recv_into(self, view: memoryview, size: int, flags: int = 0) -> int:
        size = min(size, len(self._data))
        view[:size], self._data = self._data[:size], self._data[size:]
        return size

    def sendall(self, data: bytes) -> None:
        self.held.append(tracemalloc.get_traced_memory()[0] - len(data))


def test_an_answer_to_many_forged_items_holds_none_of_them() -> None:
    uploads = Uploads(1024)
    peer = _Silent(b"".join(ITEM.pack(i, os.urandom(16), 1 << 20) for i in range(MAX_ITEMS)))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        uploads.receive(cast(socket.socket, peer), MAX_ITEMS)
    finally:
        tracemalloc.stop()
    # Parsed, the items took some 900 KB; what stays is the interpreter's free list of
    # tuples (2,000 at most, 125 KB, one for the whole process) and their answer.
    assert len(peer.held) == 1 and peer.held[0] - before < 300_000, peer.held[0] - before


def test_an_upload_cut_short_stores_nothing_and_the_endpoint_serves_on(
        endpoint: BytesEndpoint) -> None:
    uploads = _uploads(endpoint)
    later = int(time.time() * 1000) + 60_000
    cut = uploads.offer(endpoint.where, 1000, later)
    sock = _connect(endpoint)
    assert _offer_items(sock, [(cut, 1000)]) == [0]
    sock.sendall(b"y" * 400)
    sock.close()  # mid-upload
    again = _connect(endpoint)
    assert _offer_items(again, [(cut, 1000)]) == [-UploadRefusal.USED]  # single-use still
    whole = uploads.offer(endpoint.where, 10, later)
    assert _offer_items(again, [(whole, 10)]) == [0]
    again.sendall(b"0123456789")
    assert HEAD.unpack(_recv(again, HEAD.size)) == (UPLOAD_MAGIC, 1)
    again.close()
    assert uploads.take(cut.id) is None  # its reply carries the outputs itself
    assert uploads.take(whole.id) == [b"0123456789"]
    assert len(uploads) == 0


def test_uploads_on_many_threads_beside_offers_and_frees_store_each_its_own(
        endpoint: BytesEndpoint) -> None:
    uploads = _uploads(endpoint)
    later = int(time.time() * 1000) + 60_000
    rounds, threads = 40, 8
    offers = [[uploads.offer(endpoint.where, 64, later) for _ in range(rounds)]
              for _ in range(threads)]
    freed = {o.id for row in offers for o in row[::3]}
    failures: list[BaseException] = []

    def upload(row: list[Offer]) -> None:
        try:
            sock = _connect(endpoint)
            for o in row:
                status, = _offer_items(sock, [(o, 8)])
                if status == 0:
                    sock.sendall(o.id.to_bytes(8, "little"))
                    assert HEAD.unpack(_recv(sock, HEAD.size)) == (UPLOAD_MAGIC, 1)
                else:
                    assert status == -UploadRefusal.GONE and o.id in freed
            sock.close()
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    running = [threading.Thread(target=upload, args=(row,)) for row in offers]
    for thread in running:
        thread.start()
    for rid in freed:  # the event loop's frees, while the uploads go on
        uploads.free(rid)
    for thread in running:
        thread.join(PATIENCE_S)
    assert not failures, failures
    for o in (o for row in offers for o in row if o.id not in freed):
        assert uploads.take(o.id) == [o.id.to_bytes(8, "little")]
    assert len(uploads) == 0
