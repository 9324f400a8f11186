"""Fetching a batch of large inputs in one round trip on loopback: conveyor's bytes endpoint
(api/bytes_endpoint.py, batching/tensor_transport.py) against Apache Arrow Flight.

Usage: python -m bench.fetch_transport [--tensors 64] [--bytes 150528] [--rounds 200]

Each round fetches ``--tensors`` tensors of ``--bytes`` each, held by a server in this
process, and times it; CPU is this process's (server and client together) per fetch. Flight
(``pip install pyarrow``; skipped without it) serves the same bytes from ``do_get`` as one
binary column, built per fetch from the ids in the ticket, or (``prebuilt``) one table made
once, its best case. docs/data-path.md has the figures and the choice.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from api.bytes_endpoint import BytesEndpoint
from batching.tensor_transport import FetchClient

Fetch = Callable[[], list[Any]]


def plain(blobs: list[bytes]) -> tuple[Fetch, Callable[[], None]]:
    endpoint = BytesEndpoint("127.0.0.1")
    endpoint.start()
    refs = [endpoint.put(b, int(time.time() * 1000) + 3_600_000) for b in blobs]
    client = FetchClient(10.0)

    def stop() -> None:
        client.close()
        endpoint.close()
    return lambda: client.fetch(refs), stop


def flight(blobs: list[bytes], prebuilt: bool) -> tuple[Fetch, Callable[[], None]]:
    import pyarrow as pa
    import pyarrow.flight as fl

    class Server(fl.FlightServerBase):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__("grpc://127.0.0.1:0")
            self.table = pa.table([pa.array(blobs, type=pa.binary())], names=["b"])

        def do_get(self, context: Any, ticket: Any) -> Any:
            if prebuilt:
                return fl.RecordBatchStream(self.table)
            ids = [int(i) for i in ticket.ticket.decode().split(",")]
            return fl.RecordBatchStream(
                pa.table([pa.array([blobs[i] for i in ids], type=pa.binary())], names=["b"]))

    server = Server()
    threading.Thread(target=server.serve, daemon=True).start()
    client = fl.connect(f"grpc://127.0.0.1:{server.port}")
    ticket = fl.Ticket(",".join(str(i) for i in range(len(blobs))).encode())

    def fetch() -> list[Any]:
        column = client.do_get(ticket).read_all().column(0).chunk(0)
        offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)
        data = memoryview(column.buffers()[2])
        return [data[offsets[i]:offsets[i + 1]] for i in range(len(blobs))]

    def stop() -> None:
        client.close()
        server.shutdown()
    return fetch, stop


def timed(name: str, made: tuple[Fetch, Callable[[], None]], blobs: list[bytes],
          rounds: int) -> str:
    fetch, stop = made
    try:
        assert [bytes(b) for b in fetch()] == blobs
        times = []
        cpu = time.process_time()
        for _ in range(rounds):
            started = time.perf_counter()
            fetch()
            times.append(time.perf_counter() - started)
        cpu = (time.process_time() - cpu) / rounds
    finally:
        stop()
    times.sort()
    total = sum(len(b) for b in blobs)
    return (f"| {name} | {times[len(times) // 2] * 1e3:.2f} | {times[len(times) * 9 // 10] * 1e3:.2f}"
            f" | {total / statistics.median(times) / 1e9:.2f} | {cpu * 1e3:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--bytes", type=int, default=150_528)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, args.bytes, dtype=np.uint8).tobytes()
             for _ in range(args.tensors)]
    print(f"{args.tensors} x {args.bytes:,} bytes a fetch, {args.rounds} fetches each\n")
    print("| transport | p50 ms | p90 ms | GB/s | CPU ms / fetch (both sides) |")
    print("|---|---|---|---|---|")
    print(timed("bytes endpoint", plain(blobs), blobs, args.rounds))
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        print("(Arrow Flight: pyarrow is not installed)")
        return
    print(timed("Arrow Flight, table per fetch", flight(blobs, False), blobs, args.rounds))
    print(timed("Arrow Flight, prebuilt table", flight(blobs, True), blobs, args.rounds))


if __name__ == "__main__":
    main()
