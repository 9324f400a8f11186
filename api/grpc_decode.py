"""gRPC requests whose bytes are not the method's message answer INVALID_ARGUMENT.

grpc-python answers a request its deserializer cannot read with UNKNOWN (a server
error, to a client and to the fuzz run). This interceptor wraps each method's
deserializer so that such bytes become an :class:`Undecodable` marker, and the method's
behaviour aborts with INVALID_ARGUMENT when it meets one, before any of our code runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

Behaviour = Callable[..., Any]


class Undecodable:
    """What a request that failed to deserialize becomes."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def message(self) -> str:
        return f"the request is not a valid protobuf message of this method: {self.reason}"


def safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # DecodeError, or any other failure to read client bytes
            return Undecodable(f"{type(exc).__name__}: {exc}"[:200])

    return decode


def _unary(behaviour: Behaviour) -> Behaviour:
    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        return await behaviour(request, context)

    return call


def _unary_stream(behaviour: Behaviour) -> Behaviour:
    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        async for answer in behaviour(request, context):
            yield answer

    return call


def _checked(requests: AsyncIterator[Any],
             context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
    async def each() -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
            yield request

    return each()


def _stream_unary(behaviour: Behaviour) -> Behaviour:
    async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await behaviour(_checked(requests, context), context)

    return call


def _stream_stream(behaviour: Behaviour) -> Behaviour:
    async def call(requests: AsyncIterator[Any],
                   context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        async for answer in behaviour(_checked(requests, context), context):
            yield answer

    return call


class DecodeGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        decode = safe(handler.request_deserializer)
        if handler.unary_unary:
            return handler._replace(request_deserializer=decode,
                                    unary_unary=_unary(handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(request_deserializer=decode,
                                    unary_stream=_unary_stream(handler.unary_stream))
        if handler.stream_unary:
            return handler._replace(request_deserializer=decode,
                                    stream_unary=_stream_unary(handler.stream_unary))
        return handler._replace(request_deserializer=decode,
                                stream_stream=_stream_stream(handler.stream_stream))
