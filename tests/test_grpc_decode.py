"""Bytes that are not the method's message: INVALID_ARGUMENT, not UNKNOWN (api.grpc_decode).

A stand-in service whose request type is a well-known protobuf message (not api.proto,
whose symbols collide with tritonclient's in the test process).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import wrappers_pb2

from api.grpc_decode import DecodeGuard

UNARY = "/fuzz.Echo/Unary"
STREAM = "/fuzz.Echo/Stream"
NOT_A_MESSAGE = b"\xff\xff\xff"  # a truncated varint tag


async def unary(request: wrappers_pb2.StringValue, _: Any) -> wrappers_pb2.StringValue:
    return wrappers_pb2.StringValue(value=request.value.upper())


async def stream(requests: AsyncIterator[wrappers_pb2.StringValue],
                 _: Any) -> AsyncIterator[wrappers_pb2.StringValue]:
    async for request in requests:
        yield wrappers_pb2.StringValue(value=request.value.upper())


def handlers() -> grpc.GenericRpcHandler:
    decode = wrappers_pb2.StringValue.FromString
    encode = wrappers_pb2.StringValue.SerializeToString
    return grpc.method_handlers_generic_handler("fuzz.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, decode, encode),
        "Stream": grpc.stream_stream_rpc_method_handler(stream, decode, encode),
    })


async def call_both(guarded: bool) -> tuple[str, str, str]:
    server = grpc.aio.server(interceptors=[DecodeGuard()] if guarded else [])
    server.add_generic_rpc_handlers((handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            good = await channel.unary_unary(UNARY)(
                wrappers_pb2.StringValue(value="ok").SerializeToString(), timeout=10)
            codes = []
            try:
                await channel.unary_unary(UNARY)(NOT_A_MESSAGE, timeout=10)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code().name)
            call = channel.stream_stream(STREAM)(iter([NOT_A_MESSAGE]), timeout=10)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code().name)
            return wrappers_pb2.StringValue.FromString(good).value, codes[0], codes[1]
    finally:
        await server.stop(None)


def test_undecodable_requests_are_invalid_argument() -> None:
    assert asyncio.run(call_both(guarded=True)) == ("OK", "INVALID_ARGUMENT", "INVALID_ARGUMENT")


def test_without_the_guard_grpc_answers_a_server_error() -> None:
    """What the guard exists for: grpc's own answer is not a client error."""
    _, unary_code, _ = asyncio.run(call_both(guarded=False))
    assert unary_code in {"UNKNOWN", "INTERNAL"}


@pytest.mark.parametrize("raw", [b"", b"\x0a\x02ok"])
def test_valid_bytes_pass_through(raw: bytes) -> None:
    from api.grpc_decode import Undecodable, safe

    decode = safe(wrappers_pb2.StringValue.FromString)
    assert decode is not None
    assert not isinstance(decode(raw), Undecodable)
    assert isinstance(decode(NOT_A_MESSAGE), Undecodable)
