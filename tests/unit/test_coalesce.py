"""api/coalesce.py: a response's head and body leave in one write."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from api.coalesce import CoalescingTransport

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None


def make() -> tuple[Recorder, CoalescingTransport, asyncio.AbstractEventLoop]:
    loop = asyncio.get_running_loop()
    raw = Recorder()
    return raw, CoalescingTransport(cast(asyncio.Transport, raw), loop), loop


def test_head_and_body_leave_in_one_write() -> None:
    async def scenario() -> None:
        raw, transport, _ = make()
        transport.write(HEAD)
        assert raw.writes == []
        transport.write(b"{}")
        assert raw.writes == [HEAD + b"{}"]
        await asyncio.sleep(0)  # the end-of-turn flush finds nothing held
        assert raw.writes == [HEAD + b"{}"]
    asyncio.run(scenario())


def test_a_head_alone_leaves_at_the_end_of_the_turn() -> None:
    async def scenario() -> None:
        raw, transport, _ = make()
        transport.write(HEAD)
        await asyncio.sleep(0)
        assert raw.writes == [HEAD]
        transport.write(b"{}")  # a body sent later still goes out
        assert raw.writes == [HEAD, b"{}"]
    asyncio.run(scenario())


def test_close_sends_a_held_head_first() -> None:
    async def scenario() -> None:
        raw, transport, _ = make()
        transport.write(HEAD)
        transport.close()
        assert raw.writes == [HEAD] and raw.closed
    asyncio.run(scenario())


def test_other_writes_pass_through_and_the_rest_is_the_transports() -> None:
    async def scenario() -> None:
        raw, transport, _ = make()
        transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # interim: the client waits for it
        transport.write(b"5\r\nhello\r\n")  # a chunk, not a head
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n{}")  # a whole response
        assert raw.writes == [b"HTTP/1.1 100 Continue\r\n\r\n", b"5\r\nhello\r\n",
                              b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n{}"]
        assert transport.get_extra_info("peername") == ("127.0.0.1", 1)
    asyncio.run(scenario())
