"""Hostile inputs for the infer route (HTTP) and gRPC ``ModelInfer``: random and mutated.

Every case is built from one ``random.Random``, so a seed reproduces a run. A case is a
whole HTTP/1.1 request (bytes on the wire) or a serialized ``ModelInferRequest``; the
runner in :mod:`bench.fuzz` sends it and judges the answer.
"""

from __future__ import annotations

import functools
import gzip
import json
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from api.proto import inference_pb2 as pb

MODEL = "digits"
GOOD_PIXELS = [0.0, 0.0, 2.0, 13.0, 16.0, 9.0, 0.0, 0.0] * 8
"""64 FP32 pixels: a request ``digits`` accepts."""
DATATYPES = ["FP32", "FP16", "FP64", "INT8", "INT32", "INT64", "UINT8", "BOOL", "BYTES", "fp32",
             "", "FP3\u00e92", "STRING"]
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class HttpCase:
    kind: str
    wire: bytes
    """The complete request as sent (request line, headers, body)."""


@dataclass(frozen=True, slots=True)
class GrpcCase:
    kind: str
    message: bytes


def good_body() -> dict[str, Any]:
    return {"id": "fuzz", "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64],
                                      "data": list(GOOD_PIXELS)}]}


def http_request(path: str, body: bytes, headers: dict[str, str] | None = None,
                 method: str = "POST", auth: str = "") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: fuzz", "Connection: close"]
    if auth:
        lines.append(f"Authorization: Bearer {auth}")
    given = {k.lower(): v for k, v in (headers or {}).items()}
    given.setdefault("content-length", str(len(body)))
    lines += [f"{k}: {v}" for k, v in given.items() if v is not None]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + body


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(12 if depth < 4 else 8)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([True, False])
    if choice == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30])
    if choice == 3:
        return rng.choice([0.5, -1.5, 1e308, -1e-308, 3.0])
    if choice == 4:
        return "".join(rng.choice("ab\u00e9\u2603\x00/.%") for _ in range(rng.randrange(12)))
    if choice == 5:
        return rng.choice(["FP32", "pixels", "digits", "1", "-1", "true", "null", "../x"])
    if choice == 6:
        return []
    if choice == 7:
        return {}
    if choice in (8, 9):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    keys = ["name", "datatype", "shape", "data", "parameters", "inputs", "outputs", "id",
            "binary_data_size", "binary_data", "timeout", "priority", "cost",
            "binary_data_output", "shared_memory_region", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def _mutate(doc: Any, rng: random.Random) -> Any:
    """Replace one value somewhere in ``doc`` with a random JSON value (in place)."""
    node = doc
    for _ in range(rng.randrange(1, 6)):
        if isinstance(node, dict | list) and node:
            key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
            if rng.random() < 0.4 or not isinstance(node[key], dict | list):
                node[key] = _random_json(rng)
                return doc
            node = node[key]
        else:
            break
    return doc


def _path(rng: random.Random) -> str:
    if rng.random() < 0.8:
        model = MODEL
    else:
        model = rng.choice(["nope", "..%2f..%2fetc", "a" * 300, "%00", "d%C3%A9", "..", ".",
                            "digits%2f..%2fdigits", "x" * 128])
    version = rng.choice(["", "/versions/1"] * 6 + ["/versions/2", "/versions/-1", "/versions/%ff"])
    return f"/v2/models/{model}{version}/infer"


def _json_case(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    doc = good_body()
    for _ in range(rng.randrange(1, 4)):
        doc = _mutate(doc, rng)
    return "mutated_json", json.dumps(doc, allow_nan=True).encode(), {}


def _random_bytes(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    size = rng.choice([0, 1, 7, 100, 4096, 65536])
    return "random_bytes", rng.randbytes(size), {"content-type": rng.choice(
        ["application/json", "application/octet-stream", "text/plain", "\x7f"])}


def _deep_nesting(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    depth = rng.choice([600, 5000, 100_000])
    data = "[" * depth + "1" + "]" * depth
    body = ('{"inputs":[{"name":"pixels","datatype":"FP32","shape":[1,64],"data":'
            + data + "}]}").encode()
    return "deep_nesting", body, {}


def _binary_case(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    raw = rng.randbytes(rng.choice([0, 255, 256, 257, 1024]))
    size = rng.choice([len(raw), 256, -1, 2**40, 0, "x", True])
    header = json.dumps({"inputs": [{"name": "pixels", "datatype": rng.choice(DATATYPES),
                                     "shape": rng.choice([[1, 64], [2, 64], [1, 65], [0, 64]]),
                                     "parameters": {"binary_data_size": size}}]}).encode()
    length = rng.choice([str(len(header)), f"+{len(header)}", f" {len(header)}", "0", "-1",
                         str(len(header) + len(raw) + 5), "1e3", "99999999999999999999", ""])
    return "binary", header + raw, {"inference-header-content-length": length}


@functools.cache
def gzip_bomb(mib: int) -> bytes:
    """``mib`` MiB of zeros, gzipped (made once: compressing it costs the fuzzer a second)."""
    return gzip.compress(b"\0" * (mib * MIB), compresslevel=9, mtime=0)


def _compressed(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    kind = rng.randrange(4)
    if kind == 0:  # a bomb: far more than the request limit once inflated
        return "gzip_bomb", gzip_bomb(rng.choice([65, 130])), {"content-encoding": "gzip"}
    if kind == 1:
        return "bad_gzip", rng.randbytes(200), {"content-encoding": rng.choice(["gzip", "deflate"])}
    if kind == 2:
        body = zlib.compress(json.dumps(good_body()).encode())
        return "deflate_ok", body, {"content-encoding": rng.choice(["deflate", "gzip", "br", "x"])}
    truncated = gzip.compress(json.dumps(good_body()).encode())[: rng.randrange(5, 40)]
    return "truncated_gzip", truncated, {"content-encoding": "gzip"}


def _headers_case(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    body = json.dumps(good_body()).encode()
    headers = rng.choice([
        {"content-length": str(len(body) - 10)},
        {"transfer-encoding": "chunked"},
        {"content-type": "application/json; charset=utf-16"},
        {"accept-encoding": "gzip;q=0, deflate, br, *;q=2"},
        {"inference-header-content-length": "\u0663"},
        {"x-" + "a" * 1000: "b" * 8000},
    ])
    if headers.get("transfer-encoding") == "chunked":
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        headers["content-length"] = None  # type: ignore[assignment]
    return "headers", body, headers


def _oversize(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    """Announces more than the limit; sends only a little (the server must not wait for it)."""
    return "oversize_announced", b"{" * 1024, {"content-length": str(rng.choice([65, 200, 4096]) * MIB)}


def _large_valid(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    rows = rng.choice([64, 256, 1024])
    doc = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [rows, 64],
                       "data": GOOD_PIXELS * rows}]}
    return "large_valid", json.dumps(doc).encode(), {}


HTTP_MAKERS: list[tuple[float, Callable[[random.Random], tuple[str, bytes, dict[str, str]]]]] = [
    (0.35, _json_case), (0.12, _random_bytes), (0.05, _deep_nesting), (0.15, _binary_case),
    (0.08, _compressed), (0.1, _headers_case), (0.03, _oversize), (0.02, _large_valid),
]


def http_case(rng: random.Random, auth: str = "") -> HttpCase:
    weights = [w for w, _ in HTTP_MAKERS]
    maker = rng.choices([m for _, m in HTTP_MAKERS], weights)[0]
    kind, body, headers = maker(rng)
    method = "POST" if rng.random() < 0.97 else rng.choice(["GET", "PUT", "DELETE", "PATCH"])
    return HttpCase(kind, http_request(_path(rng), body, headers, method, auth))


def good_grpc() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL, id="fuzz")
    tensor = request.inputs.add(name="pixels", datatype="FP32", shape=[1, 64])
    tensor.contents.fp32_contents.extend(GOOD_PIXELS)
    return request


def grpc_case(rng: random.Random) -> GrpcCase:
    kind = rng.randrange(5)
    if kind == 0:
        return GrpcCase("random_bytes", rng.randbytes(rng.choice([0, 3, 64, 1000])))
    base = good_grpc().SerializeToString()
    if kind == 1:
        flipped = bytearray(base)
        for _ in range(rng.randrange(1, 8)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        return GrpcCase("bit_flips", bytes(flipped))
    request = good_grpc()
    tensor = request.inputs[0]
    if kind == 2:
        del tensor.shape[:]
        tensor.shape.extend(rng.choice([[], [-1, 64], [2**62, 64], [1, 65], [0], [1, 64, 1]]))
        tensor.datatype = rng.choice(DATATYPES)
    elif kind == 3:
        tensor.ClearField("contents")
        request.raw_input_contents.append(rng.randbytes(rng.choice([0, 255, 256, 257, 4096])))
        if rng.random() < 0.3:
            request.raw_input_contents.append(b"extra")
    else:
        request.model_name = rng.choice(["", "../digits", "x" * 300, "digits", "\u00e9"])
        request.model_version = rng.choice(["", "1", "2", "-1"])
        request.parameters["timeout"].bool_param = True
        request.parameters[rng.choice(["priority", "cost", "x"])].int64_param = rng.choice(
            [-1, 0, 2**62])
        request.outputs.add(name=rng.choice(["probabilities", "nope", ""]))
    return GrpcCase(f"mutated_{kind}", request.SerializeToString())
