"""How a fetch client receives a reply (batching/tensor_transport.py): over a blocking
socket bounded in the kernel, the body of a batch in one ``recv`` however the endpoint
paces it, and still cut at the fetch's deadline when the endpoint stops halfway."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from batching.tensor_arena import TensorGone
from batching.tensor_transport import COUNT, ITEM, MAGIC, FetchClient

PIECE = 100_000
PIECES = 4


class _Counted:
    """A socket that counts its ``recv_into`` calls."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.receives = 0

    def recv_into(self, *args: Any) -> int:
        self.receives += 1
        return self.sock.recv_into(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@contextmanager
def _endpoint(pieces: int) -> Iterator[tuple[str, threading.Event]]:
    """A fake bytes endpoint that answers one fetch of one ``PIECE * PIECES``-byte tensor
    with its head, then ``pieces`` of its body 20 ms apart, and holds the connection open
    until the event is set."""
    done = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            _, count = COUNT.unpack(conn.recv(COUNT.size, socket.MSG_WAITALL))
            conn.recv(ITEM.size * count, socket.MSG_WAITALL)
            conn.sendall(MAGIC + struct.pack("<q", PIECE * PIECES))
            for i in range(pieces):
                time.sleep(0.02)  # pacing the body, not synchronising
                conn.sendall(bytes([i]) * PIECE)
            done.wait(30)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.getsockname()[1]}", done
    finally:
        done.set()
        thread.join(30)
        server.close()


def _ref(where: str) -> list[Any]:
    return [where, 7, PIECE * PIECES, int(time.time() * 1000) + 60_000, bytes(16)]


def test_a_paced_body_is_received_in_one_recv(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[_Counted] = []
    connect = socket.create_connection

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(_Counted(connect(*args, **kwargs)))
        return made[-1]

    monkeypatch.setattr(socket, "create_connection", counted)
    client = FetchClient(10.0)
    with _endpoint(PIECES) as (where, done):
        got = client.fetch([_ref(where)])
        done.set()
    client.close()
    assert isinstance(got[0], memoryview)
    assert bytes(got[0]) == b"".join(bytes([i]) * PIECE for i in range(PIECES))
    assert [c.receives for c in made] == [2]  # the head, then the whole body


def test_a_body_cut_short_fails_at_the_deadline() -> None:
    client = FetchClient(0.5)
    with _endpoint(PIECES // 2) as (where, _):
        started = time.monotonic()
        got = client.fetch([_ref(where)])
        took = time.monotonic() - started
    client.close()
    assert isinstance(got[0], TensorGone) and "timed out" in str(got[0])
    assert 0.4 < took < 5.0
