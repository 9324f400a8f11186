"""Fuzz a running conveyor API: hostile HTTP infer requests and gRPC ``ModelInfer`` messages.

While the cases of :mod:`bench.fuzz_cases` go in, a canary process sends one good
``digits`` request every 50 ms over its own keep-alive connection and a sampler reads the
API's resident memory. The run passes when no answer is a 5xx (or gRPC INTERNAL/UNKNOWN),
nothing hangs, the API's RSS stays under twice its idle size plus the request limit, and
every canary request is answered within 100 ms.

    python -m bench.fuzz --url http://127.0.0.1:8000 --grpc 127.0.0.1:8001 --pid <API pid>

``tests/test_fuzz.py`` starts a stack and runs it (longer with ``CONVEYOR_FUZZ_SECONDS``).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import ParseResult, urlparse

import grpc

from bench.fuzz_cases import MIB, good_body, good_grpc, grpc_case, http_case

CANARY_EVERY_S = 0.05
CANARY_BOUND_MS = 100.0
"""Every good request is answered within this long (the issue's bound, on a quiet host)."""
BAD_GRPC = {"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNIMPLEMENTED"}
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"


@dataclass
class Report:
    seconds: float = 0.0
    http: Counter[str] = field(default_factory=Counter)
    """Answers by status ("closed": the server closed the connection without answering)."""
    grpc: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    rss_idle_mib: float = 0.0
    rss_max_mib: float = 0.0
    rss_bound_mib: float = 0.0
    canary_sent: int = 0
    canary_failed: int = 0
    canary_p50_ms: float = 0.0
    canary_p99_ms: float = 0.0
    canary_max_ms: float = 0.0
    canary_bound_ms: float = CANARY_BOUND_MS
    canary_p99_bound_ms: float = CANARY_BOUND_MS
    canary_over_100_ms: int = 0

    def problems(self) -> list[str]:
        out = [f"{len(self.failures)} server errors, e.g. {self.failures[:3]}"] if self.failures else []
        if self.hangs:
            out.append(f"{len(self.hangs)} hangs, e.g. {self.hangs[:3]}")
        if self.rss_max_mib > self.rss_bound_mib:
            out.append(f"API RSS {self.rss_max_mib:.0f} MiB > bound {self.rss_bound_mib:.0f} MiB")
        if self.canary_failed:
            out.append(f"{self.canary_failed} of {self.canary_sent} good requests failed")
        if self.canary_p99_ms > self.canary_p99_bound_ms:
            out.append(f"good requests' p99 is {self.canary_p99_ms:.0f} ms "
                       f"(> {self.canary_p99_bound_ms:.0f})")
        if self.canary_max_ms > self.canary_bound_ms:
            out.append(f"a good request took {self.canary_max_ms:.0f} ms "
                       f"(> {self.canary_bound_ms:.0f})")
        return out

    def summary(self) -> dict[str, Any]:
        doc = {k: dict(v) if isinstance(v, Counter) else v for k, v in vars(self).items()}
        doc["failures"], doc["hangs"] = self.failures[:20], self.hangs[:20]
        return doc


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, rss_mib(self.pid))


async def send_http(host: str, port: int, wire: bytes, timeout: float) -> str:
    """The status code of the answer, "closed" when none came, "hang" past ``timeout``."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return "refused"
    try:
        async def exchange() -> str:
            try:
                writer.write(wire)
                await writer.drain()
            except OSError:
                pass  # the server may refuse early (413) and reset while we still send
            try:
                line = await reader.readline()
            except OSError:
                return "closed"
            parts = line.split()
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
                return "closed"
            status = parts[1].decode()
            return status

        return await asyncio.wait_for(exchange(), timeout)
    except TimeoutError:
        return "hang"
    finally:
        writer.close()


async def http_worker(target: ParseResult, rng: random.Random, auth: str, until: float, report: Report,
                      hang_s: float) -> None:
    host, port = target.hostname or "127.0.0.1", target.port or 80
    while time.monotonic() < until:
        case = http_case(rng, auth)
        status = await send_http(host, port, case.wire, hang_s)
        report.http[status] += 1
        report.kinds[case.kind] += 1
        head = case.wire[:160]
        if status.startswith("5"):
            report.failures.append(f"http {status} {case.kind}: {head!r}")
        elif status == "hang":
            report.hangs.append(f"http {case.kind}: {head!r}")


async def grpc_worker(target: str, rng: random.Random, auth: str, until: float, report: Report,
                      hang_s: float) -> None:
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    metadata = (("authorization", f"Bearer {auth}"),) if auth else None
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        call = channel.unary_unary(INFER_METHOD)
        while time.monotonic() < until:
            case = grpc_case(rng)
            started = time.monotonic()
            try:
                await call(case.message, timeout=hang_s, metadata=metadata)
                status = "OK"
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
                if status == "DEADLINE_EXCEEDED" and time.monotonic() - started >= hang_s * 0.9:
                    status = "hang"  # our own deadline: the server never answered
            report.grpc[status] += 1
            report.kinds[f"grpc_{case.kind}"] += 1
            if status in BAD_GRPC:
                report.failures.append(f"grpc {status} {case.kind}: {case.message[:120]!r}")
            elif status == "hang":
                report.hangs.append(f"grpc {case.kind}: {case.message[:120]!r}")


async def grpc_oversize(target: str, auth: str, limit: int, report: Report) -> None:
    """One message past the limit: RESOURCE_EXHAUSTED, and its bytes are not kept."""
    options = [("grpc.max_send_message_length", -1)]
    metadata = (("authorization", f"Bearer {auth}"),) if auth else None
    request = good_grpc()
    request.raw_input_contents.append(b"\0" * (limit + MIB))
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        try:
            await channel.unary_unary(INFER_METHOD)(request.SerializeToString(), timeout=30,
                                                    metadata=metadata)
            status = "OK"
        except grpc.aio.AioRpcError as exc:
            status = exc.code().name
    report.grpc[f"oversize:{status}"] += 1
    if status != "RESOURCE_EXHAUSTED":
        report.failures.append(f"grpc oversize message answered {status}")


def canary_argv(url: str, auth: str, seconds: float, out: Path) -> list[str]:
    return [sys.executable, "-m", "bench.fuzz", "canary", "--url", url, "--key", auth,
            "--seconds", str(seconds), "--out", str(out)]


def canary(url: str, auth: str, seconds: float, out: Path) -> None:
    """Send a good request every 50 ms; write each one's latency (ms, or -status) to ``out``."""
    parsed = urlparse(url)
    body = json.dumps(good_body()).encode()
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = f"Bearer {auth}"
    conn: http.client.HTTPConnection | None = None
    results = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        started = time.perf_counter()
        try:
            if conn is None:
                conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=10)
            conn.request("POST", "/v2/models/digits/infer", body, headers)
            answer = conn.getresponse()
            answer.read()
            status = answer.status
        except (OSError, http.client.HTTPException):
            conn, status = None, 0
        elapsed = (time.perf_counter() - started) * 1000
        results.append(elapsed if status == 200 else -float(status))
        time.sleep(max(0.0, CANARY_EVERY_S - elapsed / 1000))
    out.write_text(json.dumps(results))


def fill_canary(report: Report, results: list[float]) -> None:
    good = sorted(r for r in results if r >= 0)
    report.canary_sent = len(results)
    report.canary_failed = len(results) - len(good)
    if good:
        report.canary_p50_ms = good[len(good) // 2]
        report.canary_p99_ms = good[min(len(good) - 1, int(len(good) * 0.99))]
        report.canary_max_ms = good[-1]
        report.canary_over_100_ms = sum(1 for r in good if r > CANARY_BOUND_MS)


async def fuzz(url: str, grpc_target: str, pid: int, seconds: float, seed: int = 0,
               auth: str = "", limit: int = 64 * MIB, hang_s: float = 15.0,
               canary_bound_ms: float = CANARY_BOUND_MS,
               canary_p99_bound_ms: float = CANARY_BOUND_MS, http_workers: int = 3,
               grpc_workers: int = 1) -> Report:
    report = Report(seconds=seconds, canary_bound_ms=canary_bound_ms,
                    canary_p99_bound_ms=canary_p99_bound_ms)
    report.rss_idle_mib = rss_mib(pid)
    report.rss_bound_mib = 2 * report.rss_idle_mib + limit / MIB
    sampler = RssSampler(pid)
    sampler.start()
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "canary.json"
        canary_proc = subprocess.Popen(canary_argv(url, auth, seconds, out), cwd=Path(__file__).parent.parent)
        until = time.monotonic() + seconds
        target = urlparse(url)
        tasks = [http_worker(target, random.Random(seed * 100 + i), auth, until, report, hang_s)
                 for i in range(http_workers)]
        tasks += [grpc_worker(grpc_target, random.Random(seed * 100 + 50 + i), auth, until, report,
                              hang_s) for i in range(grpc_workers)]
        tasks.append(grpc_oversize(grpc_target, auth, limit, report))
        await asyncio.gather(*tasks)
        canary_proc.wait(timeout=seconds + 30)
        fill_canary(report, json.loads(out.read_text()) if out.exists() else [])
    sampler.stop.set()
    sampler.join()
    report.rss_max_mib = sampler.peak
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("mode", nargs="?", default="fuzz", choices=["fuzz", "canary"])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    parser.add_argument("--pid", type=int, default=0, help="the API process, for its RSS")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--key", default=os.environ.get("CONVEYOR_API_KEY", ""))
    parser.add_argument("--limit", type=int, default=64 * MIB, help="CONVEYOR_MAX_REQUEST_BYTES")
    parser.add_argument("--hang-s", type=float, default=15.0, help="no answer this long is a hang")
    parser.add_argument("--canary-max-ms", type=float, default=CANARY_BOUND_MS,
                        help="the slowest good request allowed")
    parser.add_argument("--canary-p99-ms", type=float, default=CANARY_BOUND_MS,
                        help="the good requests' p99 allowed")
    parser.add_argument("--out", type=Path, help="canary: its latencies; fuzz: the report (JSON)")
    args = parser.parse_args()
    if args.mode == "canary":
        canary(args.url, args.key, args.seconds, args.out)
        return
    report = asyncio.run(fuzz(args.url, args.grpc, args.pid or os.getpid(), args.seconds, args.seed,
                              args.key, args.limit, args.hang_s, args.canary_max_ms,
                              args.canary_p99_ms))
    summary = json.dumps(report.summary(), indent=1)
    print(summary)
    if args.out:
        args.out.write_text(summary)
    problems = report.problems()
    for problem in problems:
        print("FAIL:", problem, file=sys.stderr)
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
