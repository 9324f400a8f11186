"""The native gRPC listener's HTTP/2 connection (api.h2_connection) and gRPC calls
(api.grpc_calls), in process, on the test server of tests/h2_harness.py: driven by
grpc.aio (interop with grpc C-core) and by raw frames (hostile input)."""

from __future__ import annotations

import asyncio
import itertools
import struct
import zlib
from pathlib import Path

import grpc
import hpack
import pytest
from google.protobuf.wrappers_pb2 import BytesValue
from grpc import StatusCode as Code

from api import h2_codec as h2
from api.auth import Guard, KeyStore
from api.h2_connection import MAX_FRAME_SIZE
from tests.h2_harness import (
    CHAT,
    ECHO,
    HOLD,
    INFER,
    QUIET,
    WAIT_S,
    Raw,
    ask,
    bidi,
    channel,
    grpc_message,
    limits,
    run,
    serve,
    streamed,
    value,
    waited,
)


@run
async def test_unary_round_trip() -> None:
    async with serve() as server, channel(server) as chan:
        assert await ask(chan, ECHO, b"hello") == (Code.OK, b"hello")


@run
async def test_a_call_knows_since_when_its_connection_had_no_stream_open() -> None:
    """What bounds how long its request waited unread (api/overload.py): nothing on a
    connection's first stream, the moment since the previous one ended on the next."""
    async with serve() as server, channel(server) as chan:
        assert await ask(chan, QUIET) == (Code.OK, b"none")
        code, waited = await ask(chan, QUIET)
        assert code == Code.OK and float(waited) < 0.5
        await asyncio.sleep(1.0)
        code, waited = await ask(chan, QUIET)
        assert code == Code.OK and float(waited) >= 1.0


@run
async def test_a_response_larger_than_the_client_window_arrives_whole() -> None:
    async with serve() as server, channel(server) as chan:
        big = bytes(range(256)) * 4096  # 1 MiB, far past the client's first 64 KiB window
        assert await ask(chan, ECHO, big, timeout=WAIT_S) == (Code.OK, big)


@run
async def test_a_request_larger_than_max_message_is_resource_exhausted() -> None:
    async with serve(max_message=1000) as server, channel(server) as chan:
        assert await ask(chan, ECHO, b"x" * 2000) == (Code.RESOURCE_EXHAUSTED, b"")
        assert await ask(chan, ECHO, b"x" * 900) == (Code.OK, b"x" * 900)


@run
async def test_a_response_larger_than_max_message_is_resource_exhausted() -> None:
    async with serve(max_message=1000) as server, channel(server) as chan:
        assert (await ask(chan, "/test.Svc/Expand", b"x" * 500))[0] == Code.RESOURCE_EXHAUSTED


@run
async def test_a_gzip_compressed_request_is_inflated() -> None:
    async with serve() as server, channel(server, compression=grpc.Compression.Gzip) as chan:
        payload = b"abc" * 100_000
        assert await ask(chan, ECHO, payload) == (Code.OK, payload)
        assert ("grpc-encoding", "gzip") in server.headers[-1]


@run
async def test_an_unknown_unary_method_is_unimplemented() -> None:
    async with serve() as server, channel(server) as chan:
        assert await ask(chan, "/test.Svc/Nope") == (Code.UNIMPLEMENTED, b"")


@run
async def test_an_unknown_streaming_method_is_unimplemented() -> None:
    async with serve() as server, channel(server) as chan:
        codes = {await streamed(chan, "/test.Svc/Nope", [b""]) for _ in range(30)}
        assert codes == {Code.UNIMPLEMENTED}  # racy when broken: most of 30 calls lose


@run
async def test_a_client_deadline_is_deadline_exceeded_and_cancels_the_server_task() -> None:
    async with serve() as server, channel(server) as chan:
        assert await ask(chan, HOLD, timeout=0.5) == (Code.DEADLINE_EXCEEDED, b"")
        await waited(server.cancelled)


@run
async def test_a_bidi_stream_answers_each_message_then_ends_ok() -> None:
    async with serve() as server, channel(server) as chan:
        call = bidi(chan, CHAT)
        for word in (b"one", b"two", b"three"):
            await call.write(BytesValue(value=word))
            assert (await asyncio.wait_for(call.read(), WAIT_S)).value == word.upper()
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == Code.OK


@run
async def test_a_raising_method_is_unknown_and_the_connection_keeps_working() -> None:
    async with serve() as server, channel(server) as chan:
        assert await ask(chan, "/test.Svc/Boom") == (Code.UNKNOWN, b"")
        assert await ask(chan, ECHO, b"ok") == (Code.OK, b"ok")
        assert len(server.conns) == 1


@pytest.fixture
def keyed_guard(tmp_path: Path) -> Guard:
    (tmp_path / "keys").write_text("inf-key infer\njob-key jobs\n")
    return Guard(KeyStore(tmp_path / "keys"), auth_health=False, auth_metrics=False)


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


@run
async def test_a_missing_or_unknown_key_is_unauthenticated(keyed_guard: Guard) -> None:
    async with serve(keyed_guard) as server, channel(server) as chan:
        assert await ask(chan, ECHO) == (Code.UNAUTHENTICATED, b"")
        assert await ask(chan, ECHO, metadata=bearer("nope")) == (Code.UNAUTHENTICATED, b"")
        # a refused stream is answered at its first DATA: at its headers, the client's own
        # first write would race the answer (INTERNAL); ten calls would all but never all win
        assert {await streamed(chan, CHAT, [b""]) for _ in range(10)} == {Code.UNAUTHENTICATED}
        assert await ask(chan, ECHO, b"k", metadata=bearer("job-key")) == (Code.OK, b"k")


@run
async def test_a_key_without_the_scope_is_permission_denied(keyed_guard: Guard) -> None:
    async with serve(keyed_guard) as server, channel(server) as chan:
        assert await ask(chan, INFER, metadata=bearer("job-key")) == (Code.PERMISSION_DENIED, b"")
        assert await ask(chan, INFER, b"i", metadata=bearer("inf-key")) == (Code.OK, b"i")


# --- raw HTTP/2 -----------------------------------------------------------------------
@run
async def test_the_server_stops_at_the_stream_window_and_resumes_after_window_update() -> None:
    async with serve() as server:
        raw = await Raw.connect(server, {h2.INITIAL_WINDOW_SIZE: 1000})
        raw.request(1, ECHO, BytesValue(value=b"w" * 5000).SerializeToString())
        first = b""
        while len(first) < 1000:
            first += (await raw.until(h2.DATA, 1))[1]
        assert len(first) == 1000
        with pytest.raises(TimeoutError):  # nothing more until the window opens
            await asyncio.wait_for(raw.until(h2.DATA, 1), 0.3)
        raw.send(h2.window_update(1, 10_000))
        rest, status = await raw.answer(1)
        assert (value(first + rest), status) == (b"w" * 5000, Code.OK)


@run
async def test_the_server_deadline_answers_deadline_exceeded() -> None:
    async with serve() as server:
        raw = await Raw.connect(server)
        raw.request(1, HOLD, grpc_timeout="200m")
        assert await raw.answer(1) == (b"", Code.DEADLINE_EXCEEDED)
        assert server.cancelled.is_set()


@run
async def test_the_server_deadline_runs_from_the_headers() -> None:
    async with serve() as server:
        raw = await Raw.connect(server)
        raw.request(1, ECHO, None, grpc_timeout="100m")  # headers, and no message
        assert (await asyncio.wait_for(raw.answer(1), 2.0))[1] == Code.DEADLINE_EXCEEDED


@run
async def test_rst_stream_cancels_the_server_task() -> None:
    async with serve() as server:
        raw = await Raw.connect(server)
        raw.request(1, HOLD)
        await waited(server.started)
        raw.send(h2.rst_stream(1, h2.CANCEL))
        await waited(server.cancelled)
        assert not server.conns[0].streams


@run
async def test_a_deflate_compressed_message_is_inflated() -> None:
    async with serve() as server:
        raw = await Raw.connect(server)
        raw.request(1, ECHO, zlib.compress(BytesValue(value=b"d" * 1000).SerializeToString()),
                    compressed=True, grpc_encoding="deflate")
        body, status = await raw.answer(1)
        assert (value(body), status) == (b"d" * 1000, Code.OK)


@run
async def test_a_message_inflating_past_max_message_is_resource_exhausted() -> None:
    async with serve(max_message=10_000) as server:
        raw = await Raw.connect(server)
        bomb = zlib.compress(BytesValue(value=bytes(100_000)).SerializeToString())  # ~100 bytes
        raw.request(1, ECHO, bomb, compressed=True, grpc_encoding="deflate")
        assert await raw.answer(1) == (b"", Code.RESOURCE_EXHAUSTED)


@run
async def test_a_bad_preface_closes_the_connection() -> None:
    async with serve() as server:
        raw = await Raw.connect(server, preface=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await raw.goaway())[1] == h2.PROTOCOL_ERROR
        await raw.eof()


@run
async def test_a_bad_preface_is_refused_before_24_bytes_have_come() -> None:
    async with serve() as server:
        raw = await Raw.connect(server, preface=h2.PREFACE[:16])
        await asyncio.sleep(0.05)  # a read of its own (either way, the answer is the same)
        raw.send(b"XX")  # 18 bytes in all: no longer a prefix of the preface
        assert (await raw.goaway())[1] == h2.PROTOCOL_ERROR
        await raw.eof()


@run
async def test_frames_and_messages_split_across_reads_are_joined() -> None:
    async with serve() as server:
        raw = Raw(*await asyncio.open_connection("127.0.0.1", server.port))
        server.clients.append(raw.writer)
        payload = bytes(range(256)) * 4
        message = grpc_message(BytesValue(value=payload).SerializeToString())
        head = h2.PREFACE + h2.settings_frame({})
        headers = raw.head(1, ECHO)
        data = (h2.frame(h2.DATA, 0, 1, message[:300])  # the message spans two DATA frames
                + h2.frame(h2.DATA, h2.END_STREAM, 1, message[300:]))
        wire = head + headers + data
        h, d = len(head), len(head) + len(headers)
        cuts = [0, 10, 30, h + 4, d + 11, d + 150, d + 309 + 4, d + 700, len(wire)]
        for start, stop in itertools.pairwise(cuts):  # in the preface, a frame header, ...
            raw.send(wire[start:stop])
            await asyncio.sleep(0.01)
        body, status = await raw.answer(1)
        assert (value(body), status) == (payload, Code.OK)
        raw.request(3, ECHO, BytesValue(value=b"next").SerializeToString())  # nothing left over
        body, status = await raw.answer(3)
        assert (value(body), status) == (b"next", Code.OK)


@run
async def test_a_frame_larger_than_max_frame_size_is_goaway_frame_size_error() -> None:
    async with serve() as server:
        raw = await Raw.connect(server)
        raw.send(struct.pack(">IBI", (MAX_FRAME_SIZE + 1) << 8 | h2.DATA, 0, 1))
        assert (await raw.goaway())[1] == h2.FRAME_SIZE_ERROR
        await raw.eof()


@run
async def test_streams_beyond_max_streams_are_refused() -> None:
    async with serve(conn_limits=limits(max_streams=2)) as server:
        raw = await Raw.connect(server)
        for stream_id in (1, 3, 5):
            raw.request(stream_id, HOLD)
        assert await raw.refused(5)
        assert sorted(server.conns[0].streams) == [1, 3]


@run
async def test_ping_is_answered_with_ack_and_its_payload() -> None:
    async with serve() as server:
        raw = await Raw.connect(server)
        raw.send(h2.frame(h2.PING, 0, 0, b"12345678"))
        assert await raw.until(h2.PING) == (h2.ACK, b"12345678")


@run
async def test_data_beyond_the_connection_window_is_goaway_flow_control_error() -> None:
    async with serve(conn_limits=limits(window=h2.DEFAULT_WINDOW)) as server:
        raw = await Raw.connect(server)
        raw.request(1, ECHO, None)
        message = grpc_message(bytes(80_000))  # one message: nothing is credited before its end
        raw.send(h2.frame(h2.DATA, 0, 1, message[:40_000]), h2.frame(h2.DATA, 0, 1, message[40_000:]))
        assert await raw.goaway() == (1, h2.FLOW_CONTROL_ERROR)
        await raw.eof()


@run
async def test_shut_down_sends_goaway_and_closes_once_its_streams_are_done() -> None:
    async with serve() as server:
        raw = await Raw.connect(server)
        raw.request(1, HOLD, BytesValue(value=b"last").SerializeToString())
        await waited(server.started)
        server.conns[0].shut_down()
        assert await raw.goaway() == (1, h2.NO_ERROR)
        raw.request(3, ECHO)  # after the GOAWAY: refused
        assert await raw.refused(3)
        server.release.set()  # stream 1 is still served, then the connection closes
        body, status = await raw.answer(1)
        assert (value(body), status) == (b"last", Code.OK)
        await raw.eof()


# --- HPACK ----------------------------------------------------------------------------
def test_header_block_cache_is_invalidated_by_a_block_that_adds_to_the_table() -> None:
    encoder, reference, decoder = hpack.Encoder(), hpack.Decoder(), h2.HeaderDecoder(16_384)
    first = encoder.encode([("x-a", "1")])  # a literal with incremental indexing: entry 62
    indexed = b"\xbe"  # indexed field 62, the block a client sends again and again
    for block in (first, indexed, indexed):  # the second indexed one: from the cache
        assert decoder.decode(block) == [(str(k), str(v)) for k, v in reference.decode(block)]
    assert decoder.decode(indexed) == [("x-a", "1")]
    assert decoder.decode(encoder.encode([("x-b", "2")])) == [("x-b", "2")]  # now entry 62
    assert decoder.decode(indexed) == [("x-b", "2")]
    assert decoder.decode(b"\xbf") == [("x-a", "1")]  # moved to 63
