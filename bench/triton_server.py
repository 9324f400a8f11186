"""NVIDIA Triton serving the benchmark models through pytriton, for bench/run.py's comparison.

Runs with the interpreter of bench/.triton-venv and the environment bench/triton.py gives it
(``server_env``: which libpython the backend's stub loads), not the project's: pytriton and the
tritonserver binary it bundles are a benchmark-only dependency.

Usage: python bench/triton_server.py --onnx-dir REPO --model mlp_tiny [--model ...]
           --http-port P --grpc-port P --metrics-port P [--max-batch-size 64] [--delay-us 200]
           [--threads 2]

Each model is an onnxruntime session (``--threads`` intra-op threads, spinning off so idle
threads leave the CPU to the server) behind pytriton's ``@batch``: Triton's Python backend
forms the batches (dynamic batching, ``--delay-us`` queue delay) and hands them to this process.
Input and output are INPUT0 and OUTPUT0, FP32, batch dimension dynamic, as conveyor serves them,
so the same KServe v2 request works against both.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

InferFunc = Callable[..., dict[str, np.ndarray]]


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def infer_func(sess: ort.InferenceSession) -> InferFunc:
    # @batch passes each input as a keyword named like the tensor: hence the upper-case argument.
    @batch  # type: ignore[untyped-decorator]
    def infer(INPUT0: np.ndarray) -> dict[str, np.ndarray]:
        return {"OUTPUT0": sess.run(["OUTPUT0"], {"INPUT0": INPUT0})[0]}
    return infer  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--onnx-dir", type=Path, required=True, help="holds <model>/model.onnx")
    parser.add_argument("--model", action="append", required=True, help="a model to serve (repeatable)")
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--delay-us", type=int, default=200, help="max_queue_delay_microseconds")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    args = parser.parse_args()
    # bench/run.py stops servers with SIGTERM: leave serve() as on Ctrl-C, so Triton stops too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port,
                          grpc_address="127.0.0.1", grpc_port=args.grpc_port,
                          metrics_address="127.0.0.1", metrics_port=args.metrics_port)
    with Triton(config=config) as triton:
        for name in args.model:
            sess = session(args.onnx_dir / name / "model.onnx", args.threads)
            n_in, n_out = sess.get_inputs()[0].shape[1], sess.get_outputs()[0].shape[1]
            triton.bind(model_name=name, infer_func=infer_func(sess),
                        inputs=[Tensor(name="INPUT0", dtype=np.float32, shape=(n_in,))],
                        outputs=[Tensor(name="OUTPUT0", dtype=np.float32, shape=(n_out,))],
                        config=ModelConfig(max_batch_size=args.max_batch_size, batcher=DynamicBatcher(
                            max_queue_delay_microseconds=args.delay_us)))
        triton.serve()


if __name__ == "__main__":
    main()
