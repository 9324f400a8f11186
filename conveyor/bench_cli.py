"""``conveyor bench``: drive a running conveyor, or any KServe v2 / Triton server, with one
model's requests and print throughput, latency, the mean batch size and errors
(docs/benchmarking.md).

    conveyor bench digits                                   # JSON at concurrency 1, 8, 64
    conveyor bench digits --protocol json,binary,grpc --concurrency 1,16 --duration 5
    conveyor bench digits --input rows.npy --rows 8 --json

The request comes from the model's metadata (``GET /v2/models/MODEL``: random data of
each input's datatype, a dynamic batch dim of ``--rows`` rows, other dynamic dims 1) or
from ``--input``; one request is sent first, so a request the server refuses stops the
command with the server's reason instead of measuring errors. Each point (protocol,
concurrency) runs ``--warmup`` seconds unmeasured, then ``--duration`` seconds under wrk
(HTTP) or h2load (gRPC); the server's statistics (``GET /v2/models/MODEL/stats``), read
before and after, give the mean batch size: inferences over executions in between. With
API keys on the server, ``--api-key`` (default ``CONVEYOR_API_KEY``) is sent as the bearer
key.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from batching.settings import Settings
from conveyor.bench_load import LoadResult, run_h2load, run_wrk
from conveyor.bench_request import (
    PROTOCOLS,
    BenchError,
    Body,
    Input,
    binary_body,
    body,
    file_inputs,
    random_inputs,
)

TIMEOUT_S = 30.0
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
COLUMNS = ("protocol", "concurrency", "req/s", "mean ms", "p50 ms", "p99 ms", "max ms",
           "mean batch", "errors")
NO_PERCENTILES = "n/a: h2load reports the request time's min, max, mean and sd, no percentiles"
GRPC_ERRORS = ("grpc errors: only HTTP/2 failures count; a gRPC error status (in the trailers "
               "of an HTTP 200) is not seen by h2load")
NOTHING_DONE = ("a point with 0 requests: no request finished within --duration; is the "
                "server at that address, and is one request shorter than --duration?")


@dataclass(frozen=True)
class Point:
    """One measured point of the sweep."""

    protocol: str
    concurrency: int
    result: LoadResult
    mean_batch: float | None


def add_parser(commands: Any) -> None:
    """Add the ``bench`` command to the ``conveyor`` parser's subcommands."""
    settings = Settings()
    bench = commands.add_parser("bench", help="measure a running server with one model's requests "
                                "(wrk, h2load): throughput, latency, mean batch size, errors")
    bench.add_argument("model")
    bench.add_argument("--url", default=os.environ.get("CONVEYOR_URL")
                       or f"http://127.0.0.1:{settings.http_port}",
                       help="the HTTP API (default: $CONVEYOR_URL or the local one)")
    bench.add_argument("--grpc-url", help="the gRPC API, HOST:PORT (default: --url's host, "
                       f"port CONVEYOR_GRPC_PORT, {settings.grpc_port})")
    bench.add_argument("--protocol", type=_protocols, default=["json"], dest="protocols",
                       help="json, binary or grpc, or several with commas (default: json)")
    bench.add_argument("--concurrency", type=_counts, default=[1, 8, 64],
                       help="requests in flight, one point each: 1,8,64 (default)")
    bench.add_argument("--duration", type=_positive, default=10, help="seconds measured per point (10)")
    bench.add_argument("--warmup", type=int, default=2,
                       help="seconds unmeasured before each point (2; 0: none)")
    bench.add_argument("--input", type=Path, help="the request's tensors: .npy (the one input), "
                       ".npz (one array per input) or KServe v2 .json; default: random")
    bench.add_argument("--rows", type=_positive, default=1,
                       help="rows of random inputs: the dynamic batch dim (1)")
    bench.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                       help="bearer key (default: $CONVEYOR_API_KEY)")
    bench.add_argument("--json", action="store_true", help="print the points as JSON")


def run(args: argparse.Namespace) -> int:
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, timeout=TIMEOUT_S, headers=auth) as client:
        try:
            metadata = _get(client, f"/v2/models/{quote(args.model)}")
            inputs = (file_inputs(args.input, metadata) if args.input
                      else random_inputs(metadata, args.rows))
            points = sweep(client, args, inputs, auth)
        except BenchError as exc:
            print(f"conveyor bench: {exc}", file=sys.stderr)
            return 1
        except httpx.HTTPError as exc:
            print(f"conveyor bench: cannot reach {args.url}: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    if args.json:
        print(json.dumps({"model": args.model, "duration_s": args.duration,
                          "points": [point_json(point) for point in points]}, indent=2))
    else:
        for note in notes(points):
            print(note)
    return 0


def sweep(client: httpx.Client, args: argparse.Namespace, inputs: list[Input],
          auth: dict[str, str]) -> list[Point]:
    """Every (protocol, concurrency) point, each row printed as it is measured."""
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-") as tmp:
        for protocol in args.protocols:
            request = body(protocol, args.model, inputs)
            preflight(client, args.model, request if protocol != "grpc" else binary_body(inputs))
            request = Body(request.content, {**request.headers, **auth})
            for concurrency in args.concurrency:
                point = measure(client, args, protocol, request, concurrency, Path(tmp))
                if not args.json:
                    if not points:
                        print(row(COLUMNS))
                    print(row(cells(point)), flush=True)
                points.append(point)
    return points


def measure(client: httpx.Client, args: argparse.Namespace, protocol: str, request: Body,
            concurrency: int, workdir: Path) -> Point:
    """Warm up, then one measured run between two reads of the server's statistics."""
    load: Callable[[str, Body, int, int, Path], LoadResult]
    if protocol == "grpc":
        load, target = run_h2load, grpc_target(
            args.grpc_url or f"{urlsplit(args.url).hostname}:{Settings().grpc_port}")
    else:
        load, target = run_wrk, f"{args.url.rstrip('/')}/v2/models/{quote(args.model)}/infer"
    if args.warmup > 0:
        load(target, request, concurrency, args.warmup, workdir)
    before = batch_counts(_stats(client, args.model), args.model)
    result = load(target, request, concurrency, args.duration, workdir)
    after = batch_counts(_stats(client, args.model), args.model)
    return Point(protocol, concurrency, result, mean_batch(before, after))


def preflight(client: httpx.Client, model: str, request: Body) -> None:
    """Send the request once: one the server refuses is a ``BenchError`` with its reason."""
    response = client.post(f"/v2/models/{quote(model)}/infer", content=request.content,
                           headers=request.headers)
    if not response.is_success:
        raise BenchError(f"the server refuses the request: {response.status_code}: "
                         f"{_error(response)}")


def grpc_target(grpc_url: str) -> str:
    """The URL h2load POSTs to: ``HOST:PORT`` is cleartext HTTP/2 (h2c)."""
    base = grpc_url if "://" in grpc_url else f"http://{grpc_url}"
    return base.rstrip("/") + GRPC_INFER


def batch_counts(stats: dict[str, Any] | None, model: str) -> tuple[int, int] | None:
    """(inferences, executions) of ``model`` in Triton's statistics, every version summed."""
    if stats is None:
        return None
    entries = [entry for entry in stats.get("model_stats") or [] if entry.get("name") == model]
    if not entries:
        return None
    return (sum(int(entry.get("inference_count", 0)) for entry in entries),
            sum(int(entry.get("execution_count", 0)) for entry in entries))


def mean_batch(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Inferences per execution between two reads; None without statistics or executions."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def cells(point: Point) -> tuple[str, ...]:
    result = point.result
    return (point.protocol, str(point.concurrency), f"{result.throughput:.1f}",
            _number(result.mean_ms), _number(result.p50_ms), _number(result.p99_ms),
            _number(result.max_ms), _number(point.mean_batch), str(result.errors))


def row(values: tuple[str, ...]) -> str:
    return f"{values[0]:<9}" + "".join(f"{value:>12}" for value in values[1:])


def notes(points: list[Point]) -> list[str]:
    """What a reader of the table needs to know about its blanks and its error counts."""
    found = []
    if any(point.result.p50_ms is None for point in points):
        found.append(NO_PERCENTILES)
    if any(point.protocol == "grpc" for point in points):
        found.append(GRPC_ERRORS)
    if any(point.mean_batch is None for point in points):
        found.append("mean batch n/a: the server's statistics show no execution in that point")
    if any(point.result.requests == 0 for point in points):
        found.append(NOTHING_DONE)
    return found


def point_json(point: Point) -> dict[str, Any]:
    result = asdict(point.result)
    return {"protocol": point.protocol, "concurrency": point.concurrency,
            "requests": result.pop("requests"), "throughput": result.pop("throughput"),
            "errors": result.pop("errors"), "mean_batch": point.mean_batch,
            "latency_ms": {key.removesuffix("_ms"): value for key, value in result.items()}}


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _get(client: httpx.Client, path: str) -> dict[str, Any]:
    response = client.get(path)
    if not response.is_success:
        raise BenchError(f"GET {path}: {response.status_code}: {_error(response)}")
    try:
        found: dict[str, Any] = response.json()
    except ValueError:
        raise BenchError(f"GET {path}: not JSON: {response.text[:200]}") from None
    return found


def _stats(client: httpx.Client, model: str) -> dict[str, Any] | None:
    """The server's statistics of ``model``, or None where it keeps none."""
    response = client.get(f"/v2/models/{quote(model)}/stats")
    if not response.is_success:
        return None
    found: dict[str, Any] = response.json()
    return found


def _error(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", response.text))
    except ValueError:
        return response.text[:200]


def _protocols(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    wrong = [name for name in names if name not in PROTOCOLS]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"expected {', '.join(PROTOCOLS)} (comma-separated), "
                                         f"not {text!r}")
    return names


def _positive(text: str) -> int:
    counts = _counts(text)
    if len(counts) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, not {text!r}")
    return counts[0]


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers with commas, not {text!r}")
    return counts
