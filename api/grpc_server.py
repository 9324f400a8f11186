"""The gRPC endpoint (grpc.aio, in the API process's event loop, port ``settings.grpc_port``).

``inference.GRPCInferenceService`` (KServe v2 / Triton) and the standard
``grpc.health.v1.Health``. Inference goes through the same :class:`InferenceService`
pipeline as HTTP; errors map to gRPC status codes through the one table in
:mod:`batching.errors`. Address, TLS and transport limits: :mod:`api.grpc_listener`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from api import grpc_listener
from api.grpc_calls import QUIET_SINCE, RECEIVED_AT
from api.grpc_codec import infer_response, parameters, parse_request
from api.kserve import InferRequest, Vet
from api.periodic import Periodic
from api.proto import inference_pb2 as pb
from api.proto import inference_pb2_grpc as pb_grpc
from api.repository_control import Repository
from api.routes import load_config, metadata, server_metadata
from api.service import InferenceService
from api.shared_memory import CUDA_UNSUPPORTED, DISABLED, SharedMemory
from api.stats import statistics
from batching.config import ModelConfig
from batching.errors import ConveyorError, Unsupported
from batching.settings import Settings
from batching.triton_config import ensemble_config, triton_config

log = logging.getLogger(__name__)

SERVICE_NAME = "inference.GRPCInferenceService"
STOP_GRACE_S = 5.0
"""On shutdown, running RPCs get this long to finish."""

Reply = TypeVar("Reply")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Reply]]
M = TypeVar("M", bound=Message)


def from_json(doc: dict[str, Any], message: M) -> M:
    """Fill ``message`` from the JSON form the HTTP routes answer with (one renderer)."""
    json_format.ParseDict(doc, message)
    return message


def _mapped(method: Handler[Reply]) -> Handler[Reply]:
    """Answer a :class:`ConveyorError` with its gRPC status code and message."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Reply:
        try:
            return await method(self, request, context)
        except ConveyorError as exc:
            status, message = grpc.StatusCode[exc.grpc_status], exc.message
        # Abort outside the except block and without the request: grpc keeps the abort's
        # traceback, and with it this frame, in a reference cycle with the call's state.
        # Chained to the error, or with the request in this frame, a rejected request
        # (up to the message limit) would stay in memory until a garbage collection.
        del request
        await context.abort(status, message)
        raise AssertionError("context.abort returned")  # it raises; this tells type checkers

    return wrapper


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: InferenceService, repository: Repository,
                 server_name: str = "conveyor") -> None:
        self.service = service
        self.repository = repository
        self.server_name = server_name

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.service.watch.server_ready())

    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        try:  # the version as HTTP reads it: "007" is version 7
            self.service.model(request.name, request.version)
        except ConveyorError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self.service.model_ready(request.name))

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**server_metadata(self.server_name))

    @_mapped
    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        config = self.service.model(request.name, request.version)
        return from_json(metadata(config), pb.ModelMetadataResponse())

    async def _infer(self, request: pb.ModelInferRequest, protocol: str) -> pb.ModelInferResponse:
        started = RECEIVED_AT.get() or time.perf_counter()

        async def parse(config: ModelConfig, vet: Vet) -> InferRequest:
            return parse_request(request, config)  # decoded already: the service checks it

        parsed, reply = await self.service.infer(request.model_name, parse, started, protocol,
                                                 request.model_version, QUIET_SINCE.get())
        return infer_response(request.model_name, parsed, reply.outputs)

    @_mapped
    async def ModelInfer(self, request: Any, context: Any) -> pb.ModelInferResponse:
        return await self._infer(request, "grpc")

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest],
                               context: Any) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests run concurrently; each answer (or its error) is sent as it completes."""
        answers: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def one(request: pb.ModelInferRequest) -> None:
            try:
                answers.put_nowait(pb.ModelStreamInferResponse(
                    infer_response=await self._infer(request, "grpc_stream")))
            except ConveyorError as exc:
                answers.put_nowait(pb.ModelStreamInferResponse(
                    error_message=exc.message,
                    infer_response=pb.ModelInferResponse(model_name=request.model_name,
                                                         id=request.id)))

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(one(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                await asyncio.gather(*list(running))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
        finally:
            pending = [reader, *running]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    @_mapped
    async def ModelConfig(self, request: Any, context: Any) -> pb.ModelConfigResponse:
        config = self.service.model(request.name, request.version)
        plan = self.service.ensembles.plans.get(request.name)
        doc = triton_config(config) if plan is None else ensemble_config(plan)
        doc.pop("ensemble_scheduling", None)  # not in this proto's ModelConfig (docs/protocol.md)
        return from_json({"config": doc}, pb.ModelConfigResponse())

    @_mapped
    async def ModelStatistics(self, request: Any, context: Any) -> pb.ModelStatisticsResponse:
        if request.name:
            self.service.model(request.name, request.version)
        names = [request.name] if request.name else sorted([*self.service.models,
                                                            *self.service.ensembles.plans])
        stats = await statistics(self.service.dispatcher.redis, self.service.keys, names)
        return from_json(stats, pb.ModelStatisticsResponse())

    @_mapped
    async def RepositoryIndex(self, request: Any, context: Any) -> pb.RepositoryIndexResponse:
        models = await self.repository.index(ready_only=request.ready)
        return from_json({"models": models}, pb.RepositoryIndexResponse())

    @_mapped
    async def RepositoryModelLoad(self, request: Any,
                                  context: Any) -> pb.RepositoryModelLoadResponse:
        config = load_config(parameters(request.parameters))
        await self.repository.load(request.model_name, config)
        return pb.RepositoryModelLoadResponse()

    @_mapped
    async def RepositoryModelUnload(self, request: Any,
                                    context: Any) -> pb.RepositoryModelUnloadResponse:
        await self.repository.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    @property
    def _shm(self) -> SharedMemory:
        if self.service.shm is None:  # a service built without it (tests): as if off
            raise Unsupported(DISABLED)
        return self.service.shm

    @_mapped
    async def SystemSharedMemoryStatus(self, request: Any,
                                       context: Any) -> pb.SystemSharedMemoryStatusResponse:
        regions = await self._shm.status(request.name)
        return from_json({"regions": {r["name"]: r for r in regions}},
                         pb.SystemSharedMemoryStatusResponse())

    @_mapped
    async def SystemSharedMemoryRegister(self, request: Any,
                                         context: Any) -> pb.SystemSharedMemoryRegisterResponse:
        await self._shm.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_mapped
    async def SystemSharedMemoryUnregister(
            self, request: Any, context: Any) -> pb.SystemSharedMemoryUnregisterResponse:
        await self._shm.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_mapped
    async def CudaSharedMemoryStatus(self, request: Any,
                                     context: Any) -> pb.CudaSharedMemoryStatusResponse:
        await self._shm.cuda_status(request.name)  # no region to list, or not found
        return pb.CudaSharedMemoryStatusResponse()

    @_mapped
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        raise Unsupported(CUDA_UNSUPPORTED)

    async def CudaSharedMemoryUnregister(
            self, request: Any, context: Any) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()  # no CUDA region is ever registered


class GrpcEndpoint:
    """The gRPC server and the task that keeps its health status in step with readiness."""

    def __init__(self, service: InferenceService, repository: Repository, settings: Settings,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> None:
        self._service = service
        self._interceptors = list(interceptors)
        self._servicer = InferenceServicer(service, repository, settings.server_name)
        self._settings = settings
        self._loop = Periodic("conveyor-grpc-health", settings.heartbeat_interval_s,
                              self._update_health)

    async def start(self) -> None:
        """Bind and serve; the server is built here, inside the running event loop."""
        self._server = grpc.aio.server(options=grpc_listener.server_options(self._settings),
                                       interceptors=self._interceptors)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            self._servicer, self._server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        port = grpc_listener.add_port(self._server, self._settings)
        await self._server.start()
        await self._update_health()
        self._loop.start()
        log.info("gRPC serving on %s%s", grpc_listener.address(self._settings.host, port),
                 " (TLS)" if self._settings.tls_cert_file is not None else "")

    async def close(self) -> None:
        await self._loop.close()
        await self._health.enter_graceful_shutdown()
        await self._server.stop(STOP_GRACE_S)

    async def _update_health(self) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if self._service.watch.server_ready()
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)
