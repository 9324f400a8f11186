"""The gRPC side of authentication: a server interceptor over every RPC.

The key travels as ``authorization`` metadata, ``Bearer <key>`` or the bare key. A
refused call gets UNAUTHENTICATED or PERMISSION_DENIED from a stand-in handler of the
same kind (unary or streaming) that reads no request: nothing of it is parsed, and a
stream is refused before its first message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from api.auth import Guard, Need
from batching.errors import ConveyorError

INFERENCE = "/inference.GRPCInferenceService/"
HEALTH_METHODS = frozenset({f"{INFERENCE}ServerLive", f"{INFERENCE}ServerReady",
                            f"{INFERENCE}ModelReady", "/grpc.health.v1.Health/Check",
                            "/grpc.health.v1.Health/Watch"})
ADMIN_METHODS = frozenset({f"{INFERENCE}RepositoryModelLoad",
                           f"{INFERENCE}RepositoryModelUnload"})


def grpc_need(method: str) -> Need:
    """The scope table of docs/security.md for a gRPC method."""
    if method in HEALTH_METHODS:
        return Need.HEALTH
    if method in ADMIN_METHODS:
        return Need.ADMIN
    if method.startswith(INFERENCE):
        return Need.INFER
    return Need.ANY


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        credentials = None
        for name, value in handler_call_details.invocation_metadata or ():
            if name == "authorization" and isinstance(value, str):
                credentials = value
                break
        try:
            self.guard.check(grpc_need(handler_call_details.method), credentials)
        except ConveyorError as exc:
            return _refusal(await continuation(handler_call_details),
                            grpc.StatusCode[exc.grpc_status], exc.message)
        return await continuation(handler_call_details)


def _refusal(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode,
             message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that aborts at once (unary-unary when unknown)."""

    async def unary(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)

    async def streaming(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # never reached: abort raises; this makes it a stream handler

    serializer = handler.response_serializer if handler is not None else None
    if handler is None or handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, response_serializer=serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, response_serializer=serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, response_serializer=serializer)
    return grpc.stream_stream_rpc_method_handler(streaming, response_serializer=serializer)
