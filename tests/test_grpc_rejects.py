"""A rejected gRPC ModelInfer frees its request at once, without a garbage collection.

The servicer runs in-process on a real grpc.aio server (no Redis: requests are rejected
before they would be queued). With the collector off, a request kept in a reference
cycle would be freed only by the next collection; ``gc.DEBUG_SAVEALL`` shows what that
collection would have freed.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import grpc
import pytest

from api.body import BodyLimits
from api.grpc_server import InferenceServicer
from api.metrics import ApiMetrics
from api.proto import inference_pb2 as pb
from api.proto import inference_pb2_grpc as pb_grpc
from api.service import InferenceService
from batching.config import ModelConfig
from batching.keys import Keys

CONFIG = ModelConfig.from_dict("m", {
    "backend": "python", "max_batch_size": 8,
    "inputs": [{"name": "a", "datatype": "FP32", "shape": [-1, 2]}]})
SIZE = 4 * 1024 * 1024
COUNT = 6


class AllServed:
    def model_served(self, model: str) -> bool:
        return True


def rejected(model: str) -> pb.ModelInferRequest:
    """4 MiB that do not fill shape [1, 2]: invalid for "m", unknown anywhere else."""
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="a", datatype="FP32", shape=[1, 2])
    request.raw_input_contents.append(b"\0" * SIZE)
    return request


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def cyclic_requests(model: str, stream: bool) -> tuple[list[str], int]:
    """Send COUNT rejected requests; their errors, and how many requests only a
    collection would free."""
    service = InferenceService({"m": CONFIG}, None, AllServed(), Keys("t"),  # type: ignore[arg-type]
                               ApiMetrics(), BodyLimits(64 << 20, 1 << 20, 8))
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        InferenceServicer(service, None), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    errors: list[str] = []
    try:
        async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            if stream:
                async for answer in stub.ModelStreamInfer(rejected(model) for _ in range(COUNT)):
                    errors.append(answer.error_message)
            else:
                for _ in range(COUNT):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.ModelInfer(rejected(model))
                    errors.append(f"{caught.value.code().name}: {caught.value.details()}")
                    del caught
    finally:
        await server.stop(None)
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    held = sum(isinstance(item, pb.ModelInferRequest) for item in gc.garbage)
    return errors, held


@pytest.mark.parametrize("model,error", [
    ("nope", "NOT_FOUND: unknown model 'nope'"),
    ("m", "INVALID_ARGUMENT: input 'a': 4194304 bytes of FP32 data do not fill shape [1, 2]"),
])
def test_rejected_model_infer_requests_are_freed_without_a_collection(
        collector_off: None, model: str, error: str) -> None:
    errors, held = asyncio.run(cyclic_requests(model, stream=False))
    assert len(errors) == COUNT and all(e.startswith(error) for e in errors), errors
    assert held == 0


def test_rejected_stream_requests_are_freed_without_a_collection(collector_off: None) -> None:
    errors, held = asyncio.run(cyclic_requests("nope", stream=True))
    assert errors == ["unknown model 'nope'"] * COUNT
    assert held == 0
