"""``conveyor bench``: request building, the load generators' reports, the statistics delta,
and one sweep against a real stack serving ``digits``."""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from pathlib import Path

import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from api.kserve import parse_header
from batching.config import ModelConfig
from batching.datatypes import DATATYPES, to_numpy, to_raw
from batching.envelope import Tensor
from conveyor import bench_cli, cli
from conveyor.bench_cli import (
    NO_PERCENTILES,
    Point,
    batch_counts,
    cells,
    grpc_target,
    mean_batch,
    notes,
    point_json,
    preflight,
)
from conveyor.bench_load import LoadResult, lua_string, parse_h2load, parse_wrk, wrk_script
from conveyor.bench_request import (
    INT_END,
    BenchError,
    Input,
    binary_body,
    file_inputs,
    grpc_body,
    json_body,
    random_inputs,
    request_shape,
)
from tests.conftest import MODELS, MakeStack
from tests.procs import free_port

TYPES = sorted(DATATYPES)
METADATA = {"name": "all", "inputs": [{"name": f"IN_{d}", "datatype": d, "shape": [-1, 2]}
                                      for d in TYPES]}
CONFIG = ModelConfig.from_dict("all", {"backend": "python", "max_batch_size": 8,
                                       "inputs": METADATA["inputs"],
                                       "outputs": [{"name": "o", "datatype": "FP32", "shape": [-1, 1]}]})

WRK = """\
Running 1s test @ http://127.0.0.1:18000/v2/models/digits/infer
  2 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     4.29ms    8.09ms  66.58ms   93.56%
    Req/Sec   416.71    241.56     1.12k    76.19%
  Latency Distribution
     50%  184.00us
     75%    3.19ms
     90%    7.84ms
     99%    1.02s
  872 requests in 1.10s, 308.43KB read
Requests/sec:    792.92
Transfer/sec:    280.46KB
"""
WRK_ERRORS = """\
Running 1s test @ http://127.0.0.1:18000/v2/models/nope/infer
  1 threads and 1 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   162.28us  309.84us    1.50s    96.43%
    Req/Sec     8.39k     1.61k   11.18k    60.00%
  Latency Distribution
     50%  102.00us
     75%  141.00us
     90%  182.00us
     99%    1.76ms
  8349 requests in 1.00s, 1.31MB read
  Socket errors: connect 1, read 2, write 3, timeout 4
  Non-2xx or 3xx responses: 8339
Requests/sec:   8338.26
Transfer/sec:      1.30MB
"""
H2LOAD = """\
starting benchmark...
spawning thread #0: 1 total client(s). Timing-based test with 0s of warm-up time and 1s of main \
duration for measurements.
Application protocol: h2c

finished in 1.00s, 730.00 req/s, 103.10KB/s
requests: 730 total, 732 started, 730 done, 725 succeeded, 3 failed, 1 errored, 1 timeout
status codes: 727 2xx, 0 3xx, 3 4xx, 0 5xx
traffic: 103.10KB (105573) total, 2.29KB (2340) headers (space savings 96.04%), 60.60KB (62050) data
                     min         max         mean         sd        +/- sd
time for request:     1.15ms     13.81ms    272us      1.48ms    84.38%
time for connect:       25us        54us        39us        20us   100.00%
time to 1st byte:     3.85ms      7.92ms      5.88ms      2.88ms   100.00%
req/s           :     364.78      364.79      364.79        0.01   100.00%
"""


def test_dynamic_dims_become_rows_for_the_batch_and_one_elsewhere() -> None:
    assert request_shape([-1, 64], 3) == (3, 64)
    assert request_shape([-1, -1, 2], 3) == (3, 1, 2)
    assert request_shape([4, -1], 3) == (4, 1)


def test_random_inputs_have_each_datatype_and_shape() -> None:
    inputs = random_inputs(METADATA, rows=3)
    assert [item.name for item in inputs] == [f"IN_{d}" for d in TYPES]
    for item in inputs:
        assert item.array.shape == (3, 2)
        if item.datatype == "BYTES":
            assert all(isinstance(v, bytes) and v.isalpha() for v in item.array.reshape(-1))
        else:
            assert item.array.dtype == to_numpy(item.datatype)
            assert item.array.min() >= 0 and item.array.max() < INT_END


def test_a_model_without_declared_inputs_needs_a_file() -> None:
    with pytest.raises(BenchError, match="--input"):
        random_inputs({"name": "m", "inputs": []}, rows=1)


def _raws(tensors: list[Tensor]) -> dict[str, bytes]:
    return {tensor.name: bytes(tensor.raw) for tensor in tensors}


def test_json_and_binary_bodies_parse_as_the_server_reads_them() -> None:
    inputs = random_inputs(METADATA, rows=3)
    expected = {item.name: to_raw(item.array) for item in inputs}
    sent = json_body(inputs)
    assert sent.headers == {"Content-Type": "application/json"}
    assert _raws(parse_header(sent.content, memoryview(b""), CONFIG).inputs) == expected
    sent = binary_body(inputs)
    length = int(sent.headers["Inference-Header-Content-Length"])
    parsed = parse_header(sent.content[:length], memoryview(sent.content[length:]), CONFIG)
    assert _raws(parsed.inputs) == expected
    assert parsed.binary_default


def test_json_cannot_carry_bytes_that_are_not_text() -> None:
    with pytest.raises(BenchError, match="--protocol binary"):
        json_body([Input("s", "BYTES", np.array([b"\xff"], dtype=np.object_))])


def test_grpc_body_is_one_framed_model_infer_request() -> None:
    inputs = random_inputs(METADATA, rows=3)
    sent = grpc_body("all", inputs)
    assert sent.headers == {"Content-Type": "application/grpc", "TE": "trailers"}
    flag, length = struct.unpack(">BI", sent.content[:5])
    assert (flag, length) == (0, len(sent.content) - 5)
    message = service_pb2.ModelInferRequest()
    message.ParseFromString(sent.content[5:])
    assert message.model_name == "all"
    assert [(t.name, t.datatype, list(t.shape)) for t in message.inputs] == [
        (item.name, item.datatype, [3, 2]) for item in inputs]
    assert list(message.raw_input_contents) == [to_raw(item.array) for item in inputs]


def test_file_inputs(tmp_path: Path) -> None:
    pixels = np.arange(128, dtype=np.float32).reshape(2, 64)
    digits = {"name": "digits", "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}]}
    np.save(tmp_path / "one.npy", pixels)
    [item] = file_inputs(tmp_path / "one.npy", digits)
    assert (item.name, item.datatype) == ("pixels", "FP32") and np.array_equal(item.array, pixels)
    np.savez(tmp_path / "many.npz", a=pixels, s=np.array([["x"], ["yz"]]))
    a, s = file_inputs(tmp_path / "many.npz", digits)
    assert (a.name, s.name, s.datatype) == ("a", "s", "BYTES")
    assert to_raw(s.array) == struct.pack("<I", 1) + b"x" + struct.pack("<I", 2) + b"yz"
    (tmp_path / "body.json").write_text(json.dumps({"inputs": [
        {"name": "t", "datatype": "INT16", "shape": [1, 2], "data": [1, 2]},
        {"name": "s", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}))
    t, s = file_inputs(tmp_path / "body.json", digits)
    assert t.array.dtype == np.int16 and t.array.tolist() == [[1, 2]]
    assert s.array.tolist() == [b"hi"]
    with pytest.raises(BenchError, match="2 inputs"):
        file_inputs(tmp_path / "one.npy", {"name": "m", "inputs": [{"name": "a"}, {"name": "b"}]})
    with pytest.raises(BenchError, match=r"expected a \.npy"):
        file_inputs(tmp_path / "rows.csv", digits)


def test_parse_wrk() -> None:
    assert parse_wrk(WRK) == LoadResult(requests=872, throughput=792.92, mean_ms=4.29, p50_ms=0.184,
                                        p99_ms=1020.0, max_ms=66.58, errors=0)
    found = parse_wrk(WRK_ERRORS)
    assert (found.errors, found.max_ms) == (8339 + 10, 1500.0)
    assert found.mean_ms == pytest.approx(0.16228)


def test_parse_h2load_has_no_percentiles() -> None:
    assert parse_h2load(H2LOAD) == LoadResult(requests=730, throughput=730.0, mean_ms=0.272,
                                              p50_ms=None, p99_ms=None, max_ms=13.81, errors=5)


def test_an_unreadable_report_is_a_bench_error() -> None:
    with pytest.raises(BenchError, match="wrk's report"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused")


def test_wrk_script_posts_the_body_with_escaped_headers(tmp_path: Path) -> None:
    assert lua_string('a"b\\c\né') == '"a\\034b\\092c\\010\\195\\169"'
    script = wrk_script(tmp_path / "body", {"Authorization": 'Bearer k"y'})
    assert 'wrk.method = "POST"' in script
    assert 'wrk.headers["Authorization"] = "Bearer k\\034y"' in script
    assert f'io.open("{tmp_path}/body", "rb")' in script


def test_mean_batch_is_the_delta_of_inferences_over_executions() -> None:
    def stats(inferences: int, executions: int) -> dict[str, object]:
        return {"model_stats": [
            {"name": "m", "version": "1", "inference_count": inferences, "execution_count": executions,
             "batch_stats": []},
            {"name": "other", "version": "1", "inference_count": 999, "execution_count": 1}]}

    before, after = batch_counts(stats(10, 10), "m"), batch_counts(stats(110, 35), "m")
    assert (before, after) == ((10, 10), (110, 35))
    assert mean_batch(before, after) == 4.0
    assert mean_batch(after, after) is None  # nothing executed in between
    assert batch_counts(None, "m") is None and batch_counts(stats(1, 1), "x") is None


def test_table_cells_and_notes() -> None:
    wrk = Point("binary", 8, parse_wrk(WRK), 2.5)
    h2 = Point("grpc", 8, parse_h2load(H2LOAD), None)
    assert cells(wrk) == ("binary", "8", "792.9", "4.29", "0.18", "1020.00", "66.58", "2.50", "0")
    assert cells(h2)[4:6] == ("n/a", "n/a")
    assert notes([wrk]) == []
    assert NO_PERCENTILES in notes([wrk, h2]) and len(notes([wrk, h2])) == 3
    assert point_json(h2)["latency_ms"] == {"mean": 0.272, "p50": None, "p99": None, "max": 13.81}


def test_grpc_target() -> None:
    path = "/inference.GRPCInferenceService/ModelInfer"
    assert grpc_target("localhost:8001") == f"http://localhost:8001{path}"
    assert grpc_target("https://h:443/") == f"https://h:443{path}"


def test_a_refused_request_stops_with_the_servers_reason() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "input 'pixels': wrong shape"})

    with (httpx.Client(base_url="http://server", transport=httpx.MockTransport(answer)) as client,
          pytest.raises(BenchError, match="400: input 'pixels': wrong shape")):
        preflight(client, "digits", json_body(random_inputs(METADATA, rows=1)))


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="conveyor")
    bench_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "digits", "--protocol", "json,grpc", "--concurrency", "1,4"])
    assert (args.protocols, args.concurrency, args.duration, args.rows) == (["json", "grpc"], [1, 4], 10, 1)
    for argv in (["--concurrency", "0"], ["--concurrency", "a"], ["--protocol", "http"], ["--rows", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "digits", *argv])
    assert "--protocol: expected json, binary, grpc" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (make deps)")
def test_bench_sweeps_a_real_stack(make_stack: MakeStack, capsys: pytest.CaptureFixture[str]) -> None:
    grpc_port = free_port()
    stack = make_stack(MODELS, CONVEYOR_GRPC_PORT=str(grpc_port), CONVEYOR_MODELS="digits")
    stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    protocols = ["json", "binary"] + (["grpc"] if shutil.which("h2load") else [])
    assert cli.main(["bench", "digits", "--url", stack.url, "--grpc-url", f"127.0.0.1:{grpc_port}",
                     "--protocol", ",".join(protocols), "--concurrency", "2", "--duration", "1",
                     "--warmup", "0", "--rows", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [point["protocol"] for point in report["points"]] == protocols
    for point in report["points"]:
        assert point["requests"] > 0 and point["throughput"] > 0 and point["errors"] == 0
        assert point["mean_batch"] >= 2  # rows per execution: two per request at least
        assert point["latency_ms"]["mean"] > 0
