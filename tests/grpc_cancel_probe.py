"""Run by tests/test_scheduling_stack.py in its own process (the test process never imports
api.proto): send one ModelInfer (input ``x``, FP32 [1, 4], every value ``value``), print
``sent``, cancel the call when a line comes on standard input, and print ``cancelled``.

``python -m tests.grpc_cancel_probe <address> <model> <value>``
"""

from __future__ import annotations

import sys

import grpc
import numpy as np

from api.proto import inference_pb2 as pb
from api.proto import inference_pb2_grpc as pb_grpc


def main() -> int:
    address, model, value = sys.argv[1], sys.argv[2], float(sys.argv[3])
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
        call = stub.ModelInfer.future(pb.ModelInferRequest(
            model_name=model, inputs=[tensor],
            raw_input_contents=[np.full((1, 4), value, np.float32).tobytes()]), timeout=60)
        print("sent", flush=True)
        sys.stdin.readline()
        call.cancel()
        print("cancelled" if call.cancelled() else "finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
