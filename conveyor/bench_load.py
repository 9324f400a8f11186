"""The C load generators under ``conveyor bench``: wrk for HTTP, h2load for gRPC, and
what their reports say.

A Python client would measure itself before the server; wrk and h2load keep a core
busy at tens of thousands of requests a second. Each sends one fixed body over
``concurrency`` connections, one request in flight on each (a closed loop, like
perf_analyzer's concurrency mode), for ``duration`` seconds. ``make deps`` installs both
(Debian packages ``wrk`` and ``nghttp2-client``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from conveyor.bench_request import BenchError, Body

REQUEST_TIMEOUT_S = 30
"""A request unanswered this long counts as an error (the server's default deadline)."""
_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
_TIME = r"([\d.]+)(us|ms|s|m|h)"
_PACKAGES = {"wrk": "wrk", "h2load": "nghttp2-client"}


@dataclass(frozen=True)
class LoadResult:
    """One run's figures; a percentile the tool does not report is None."""

    requests: int
    throughput: float
    mean_ms: float
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float
    errors: int


def run_wrk(url: str, body: Body, concurrency: int, duration_s: int, workdir: Path,
            threads: int | None = None) -> LoadResult:
    """POST ``body`` to ``url`` with wrk (``threads``: one per core, at most one per
    connection, unless given); non-2xx answers and socket errors are errors."""
    (workdir / "body").write_bytes(body.content)
    script = workdir / "request.lua"
    script.write_text(wrk_script(workdir / "body", body.headers))
    output = _run([_tool("wrk"), "-t", str(threads or _threads(concurrency)), "-c", str(concurrency),
                   "-d", f"{duration_s}s", "--timeout", f"{REQUEST_TIMEOUT_S}s", "--latency",
                   "-s", str(script), url], duration_s)
    return parse_wrk(output)


def run_h2load(url: str, body: Body, concurrency: int, duration_s: int, workdir: Path) -> LoadResult:
    """POST ``body`` to ``url`` over HTTP/2 (h2c for http://) with h2load."""
    path = workdir / "body"
    path.write_bytes(body.content)
    headers = [arg for name, value in body.headers.items() for arg in ("-H", f"{name.lower()}: {value}")]
    output = _run([_tool("h2load"), "-t", str(_threads(concurrency)), "-c", str(concurrency),
                   "-m", "1", "-D", str(duration_s), "-d", str(path), *headers, url], duration_s)
    return parse_h2load(output)


def wrk_script(body_path: Path, headers: dict[str, str]) -> str:
    """The Lua script that makes wrk POST the body file with ``headers``."""
    lines = [wrk_post(headers), f"local file = assert(io.open({lua_string(str(body_path))}, \"rb\"))",
             'wrk.body = file:read("*a")', "file:close()"]
    return "\n".join(lines) + "\n"


def wrk_post(headers: dict[str, str]) -> str:
    """wrk's Lua lines that make its requests POSTs with ``headers``."""
    return "\n".join(['wrk.method = "POST"', *(
        f"wrk.headers[{lua_string(name)}] = {lua_string(value)}" for name, value in headers.items())])


def lua_string(text: str) -> str:
    """``text`` as a Lua string literal: anything but printable ASCII as decimal escapes."""
    return '"' + "".join(
        char if char.isascii() and char.isprintable() and char not in '"\\'
        else "".join(f"\\{byte:03d}" for byte in char.encode())
        for char in text) + '"'


def parse_wrk(output: str) -> LoadResult:
    """wrk's report (run with ``--latency``)."""
    latency = _search(r"^\s*Latency\s+" + _TIME + r"\s+\S+\s+" + _TIME, output, "wrk")
    percentiles = {int(p): _ms(value, unit)
                   for p, value, unit in re.findall(r"^\s*(\d+)%\s+" + _TIME, output, re.M)}
    socket = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    status = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    return LoadResult(
        requests=int(_search(r"(\d+) requests in", output, "wrk")[0]),
        throughput=float(_search(r"Requests/sec:\s+([\d.]+)", output, "wrk")[0]),
        mean_ms=_ms(latency[0], latency[1]),
        p50_ms=percentiles.get(50),
        p99_ms=percentiles.get(99),
        max_ms=_ms(latency[2], latency[3]),
        errors=(sum(map(int, socket.groups())) if socket else 0) + (int(status[1]) if status else 0),
    )


def parse_h2load(output: str) -> LoadResult:
    """h2load's report: it gives the request time's min, max, mean and sd, no percentiles.
    Failed (non-2xx), errored and timed-out requests are errors; a gRPC error is an HTTP 200
    with the status in its trailers, which h2load does not read."""
    counts = _search(r"requests: (\d+) total, \d+ started, \d+ done, \d+ succeeded, (\d+) failed, "
                     r"(\d+) errored, (\d+) timeout", output, "h2load")
    times = _search(r"time for request:\s+" + _TIME + r"\s+" + _TIME + r"\s+" + _TIME, output, "h2load")
    return LoadResult(
        requests=int(counts[0]),
        throughput=float(_search(r"finished in [\d.]+\w+, ([\d.]+) req/s", output, "h2load")[0]),
        mean_ms=_ms(times[4], times[5]),
        p50_ms=None,
        p99_ms=None,
        max_ms=_ms(times[2], times[3]),
        errors=sum(map(int, counts[1:])),
    )


def _search(pattern: str, output: str, tool: str) -> tuple[str, ...]:
    found = re.search(pattern, output, re.M)
    if found is None:
        raise BenchError(f"{tool}'s report has no line like /{pattern}/:\n{output}")
    return found.groups()


def _ms(value: str, unit: str) -> float:
    return float(value) * _UNITS_MS[unit]


def _threads(concurrency: int) -> int:
    return max(1, min(concurrency, os.cpu_count() or 1))


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BenchError(f"{name} is not installed: `make deps` installs it (Debian package "
                         f"{_PACKAGES[name]})")
    return path


def _run(argv: list[str], duration_s: int) -> str:
    """The tool's report; a tool that fails (a refused connection) is a ``BenchError``."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False,
                              timeout=duration_s + REQUEST_TIMEOUT_S + 10)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{Path(argv[0]).name} did not finish") from None
    if done.returncode != 0:
        raise BenchError(f"{Path(argv[0]).name} failed ({done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()}")
    return done.stdout
