"""Run by tests/test_grpc_rejects.py in its own process (api.proto and tritonclient's
generated modules cannot share one): send rejected ModelInfer requests to the servicer on
an in-process grpc.aio server with the collector off, and print, as JSON, the errors and
how many requests only a garbage collection would have freed.

``python -m tests.grpc_rejects_probe <model> unary|stream``
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys

import grpc

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
LIMIT = 64 << 20


class AllServed:
    def model_served(self, model: str) -> bool:
        return True


def rejected(model: str) -> pb.ModelInferRequest:
    """4 MiB that do not fill shape [1, 2]: invalid for "m", unknown anywhere else."""
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="a", datatype="FP32", shape=[1, 2])
    request.raw_input_contents.append(b"\0" * SIZE)
    return request


async def probe(model: str, stream: bool) -> dict[str, object]:
    service = InferenceService({"m": CONFIG}, None, AllServed(), Keys("t"),  # type: ignore[arg-type]
                               ApiMetrics(), BodyLimits(LIMIT, 1 << 20, 8))
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", LIMIT)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        InferenceServicer(service, None), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    errors: list[str] = []
    gc.collect()
    gc.disable()
    try:
        async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", LIMIT)]) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            if stream:
                async for answer in stub.ModelStreamInfer(rejected(model) for _ in range(COUNT)):
                    errors.append(answer.error_message)
            else:
                for _ in range(COUNT):
                    try:
                        await stub.ModelInfer(rejected(model))
                        errors.append("OK")
                    except grpc.aio.AioRpcError as exc:
                        errors.append(f"{exc.code().name}: {exc.details()}")
    finally:
        await server.stop(None)
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    held = sum(isinstance(item, pb.ModelInferRequest) for item in gc.garbage)
    return {"errors": errors, "held": held, "count": COUNT}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(probe(sys.argv[1], sys.argv[2] == "stream"))))
