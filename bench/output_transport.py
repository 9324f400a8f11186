"""Sending a batch's large outputs back to their API process on loopback: pushed by the
inference process to the API's bytes endpoint (what conveyor does: api/output_upload.py,
workers/output_push.py), pulled by the API from an endpoint the inference process would
hold them on (the input fetch's protocol reversed), and inside the Redis replies.

Usage: python -m bench.output_transport [--tensors 64] [--bytes 150528] [--rounds 200]
       [--redis redis://127.0.0.1:6379/0]

Each round sends ``--tensors`` outputs of ``--bytes`` each, one per request, and times it;
CPU is this process's (both sides together) per round; through Redis (only with
``--redis``), also Redis's own CPU (``INFO cpu``). docs/data-path.md has the figures and
the choice.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import cast

import numpy as np
import redis

from api.bytes_endpoint import BytesEndpoint
from api.output_offers import OutputOffers
from api.output_upload import Uploads
from batching.config import ModelConfig, TensorSpec
from batching.envelope import Reply, Request, Tensor
from batching.former import Entry
from batching.tensor_transport import FetchClient
from workers.output_push import OutputPush

Round = Callable[[], None]


def _model(size: int) -> ModelConfig:
    return ModelConfig(name="m", backend="python", max_batch_size=8,
                       inputs=(TensorSpec("x", "UINT8", (-1, 1)),),
                       outputs=(TensorSpec("y", "UINT8", (-1, size)),))


def push(blobs: list[bytes]) -> tuple[Round, Callable[[], None]]:
    endpoint = BytesEndpoint("127.0.0.1")
    endpoint.start()
    offers = OutputOffers(Uploads(1), endpoint, {"m": _model(len(blobs[0]))},
                          lambda model: True, 1 << 30)
    client = OutputPush(10.0)

    def one() -> None:
        later = int(time.time() * 1000) + 60_000
        answered, offered = [], []
        for i, blob in enumerate(blobs):
            request = Request(str(i), "r", later, 0.0, 1, [])
            offer = offers.offer("m", request, 1)
            assert offer is not None
            reply = Reply(request.id, [Tensor("y", "UINT8", (1, len(blob)), blob)])
            answered.append((Entry("s", f"{i}-0", request, 0.0), reply))
            offered.append(offer)
        client.push(answered)
        for (_, reply), offer in zip(answered, offered, strict=True):
            offers.resolve(offer, Reply.decode(reply.encode()))

    def stop() -> None:
        client.close()
        endpoint.close()
    return one, stop


def pull(blobs: list[bytes]) -> tuple[Round, Callable[[], None]]:
    endpoint = BytesEndpoint("127.0.0.1")
    endpoint.start()
    client = FetchClient(10.0)

    def one() -> None:
        later = int(time.time() * 1000) + 60_000
        refs = [endpoint.put(blob, later) for blob in blobs]
        got = client.fetch(refs)
        assert all(isinstance(g, memoryview) for g in got)
        for ref in refs:
            endpoint.free(ref)

    def stop() -> None:
        client.close()
        endpoint.close()
    return one, stop


def through_redis(blobs: list[bytes], url: str) -> tuple[Round, Callable[[], None]]:
    client = redis.Redis.from_url(url)
    key = "bench:output_transport:reply"

    def one() -> None:
        replies = [Reply(str(i), [Tensor("y", "UINT8", (1, len(b)), b)]).encode()
                   for i, b in enumerate(blobs)]
        pipe = client.pipeline(transaction=False)
        pipe.rpush(key, *replies)
        pipe.expire(key, 300)
        pipe.execute()
        popped = client.blmpop(1, 1, key, direction="LEFT", count=len(blobs))
        assert popped is not None
        for data in cast(list[bytes], popped[1]):
            Reply.decode(data)

    return one, client.close


def _redis_cpu(url: str) -> float:
    info = redis.Redis.from_url(url).info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--bytes", type=int, default=150_528)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--redis", default="")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, args.bytes, dtype=np.uint8).tobytes()
             for _ in range(args.tensors)]
    ways: dict[str, Callable[[], tuple[Round, Callable[[], None]]]] = {
        "push to the API (conveyor)": lambda: push(blobs),
        "pull by the API": lambda: pull(blobs),
    }
    if args.redis:
        ways["in the Redis replies"] = lambda: through_redis(blobs, args.redis)
    total = args.tensors * args.bytes
    for name, make in ways.items():
        one, stop = make()
        for _ in range(5):
            one()
        times = []
        redis_before = _redis_cpu(args.redis) if args.redis else 0.0
        cpu = time.process_time()
        for _ in range(args.rounds):
            began = time.perf_counter()
            one()
            times.append(time.perf_counter() - began)
        cpu_ms = (time.process_time() - cpu) / args.rounds * 1e3
        redis_ms = ((_redis_cpu(args.redis) - redis_before) / args.rounds * 1e3
                    if args.redis else 0.0)
        stop()
        p50 = statistics.median(times)
        print(f"{name:28s} p50 {p50 * 1e3:6.2f} ms  {total / p50 / 1e9:5.2f} GB/s  "
              f"CPU {cpu_ms:6.2f} ms/round  Redis CPU {redis_ms:6.2f} ms/round")


if __name__ == "__main__":
    main()
