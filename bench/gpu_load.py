"""The GPU benchmark's load: client processes that each keep some requests in flight
(aiohttp, else httpx), and the GPU's utilisation sampled meanwhile (nvidia-smi)."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import threading
import time
from typing import Any


def client_run(url: str, body: bytes, headers: dict[str, str], conns: int,
               duration_s: float) -> dict[str, Any]:
    """One client process: ``conns`` concurrent request loops for ``duration_s``; the
    latencies (ms) of the 200s, the errors, the time taken and the client used."""
    latencies: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    end = start + duration_s
    try:
        client = asyncio.run(_drive_aiohttp(url, body, headers, conns, end, latencies, errors))
    except ImportError:
        client = asyncio.run(_drive_httpx(url, body, headers, conns, end, latencies, errors))
    return {"latencies": latencies, "errors": len(errors), "error_samples": errors[:3],
            "elapsed_s": time.perf_counter() - start, "client": client}


async def _drive_aiohttp(url: str, body: bytes, headers: dict[str, str], conns: int, end: float,
                         latencies: list[float], errors: list[str]) -> str:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns),
                                     timeout=timeout) as session:
        async def loop() -> None:
            while (t0 := time.perf_counter()) < end:
                try:
                    async with session.post(url, data=body, headers=headers) as response:
                        data = await response.read()
                        status = response.status
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    continue
                if status == 200:
                    latencies.append((time.perf_counter() - t0) * 1e3)
                else:
                    errors.append(f"{status}: {data[:200]!r}")

        await asyncio.gather(*(loop() for _ in range(conns)))
    return f"aiohttp {aiohttp.__version__}"


async def _drive_httpx(url: str, body: bytes, headers: dict[str, str], conns: int, end: float,
                       latencies: list[float], errors: list[str]) -> str:
    """The same as ``_drive_aiohttp``, where aiohttp is not installed."""
    import httpx

    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    async with httpx.AsyncClient(limits=limits, timeout=60) as session:
        async def loop() -> None:
            while (t0 := time.perf_counter()) < end:
                try:
                    response = await session.post(url, content=body, headers=headers)
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    continue
                if response.status_code == 200:
                    latencies.append((time.perf_counter() - t0) * 1e3)
                else:
                    errors.append(f"{response.status_code}: {response.content[:200]!r}")

        await asyncio.gather(*(loop() for _ in range(conns)))
    return f"httpx {httpx.__version__}"


class GpuSampler:
    """nvidia-smi utilisation and memory, sampled once a second in a thread (CUDA only)."""

    def __init__(self, device: str) -> None:
        self.enabled = device.startswith("cuda")
        self.index = device.partition(":")[2] or "0"
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        if self.enabled:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(Exception):
                out = subprocess.run(["nvidia-smi", "-i", self.index,
                                      "--query-gpu=utilization.gpu,memory.used",
                                      "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                util, mem = (float(v) for v in out.strip().split(","))
                self.samples.append((util, mem))

    def summary(self) -> dict[str, float] | None:
        if not self.samples:
            return None
        return {"util_mean_pct": round(statistics.fmean(u for u, _ in self.samples), 1),
                "mem_used_mib_max": max(m for _, m in self.samples), "samples": len(self.samples)}
