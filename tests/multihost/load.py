"""The multi-host test's client host: closed-loop HTTP clients on keep-alive connections to
each API, every answer written down.

Run inside the client namespace (the test starts it with ``ip netns exec``)::

    python -m tests.multihost.load OUT STOP URL [URL...] --clients N

It waits until every API says it is ready, writes ``{"ready": t}`` to OUT (JSON lines),
then runs ``N`` clients per API, each with its own connection, until the file STOP exists.
Each request's line: the API's index, the client, the request's value, when it was sent and
answered (``time.monotonic()``, the same clock as the test's), the status (0: no HTTP
answer, ``error`` names the exception) and, for a 200, whether it carried its own input
doubled. A client whose API gave no answer stops there: its host is gone. The last line is
``{"sent": n, "end": t}``: every request sent has its line before it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

READY_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 60.0
PER_CLIENT = 100_000
"""Values of client ``k`` are ``k * PER_CLIENT + i``: unique, and exact in FP32."""


class Recorder:
    def __init__(self, out: Path) -> None:
        self.file = out.open("a")
        self.sent = 0

    def write(self, line: dict[str, Any]) -> None:
        self.file.write(json.dumps(line) + "\n")

    async def flush_every(self, seconds: float) -> None:
        while True:
            self.file.flush()
            await asyncio.sleep(seconds)


async def wait_ready(urls: list[str]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with httpx.AsyncClient(timeout=5) as client:
        for url in urls:
            while True:
                try:
                    if (await client.get(f"{url}/v2/health/ready")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{url} not ready after {READY_TIMEOUT_S:.0f}s")
                await asyncio.sleep(0.2)


async def client_loop(recorder: Recorder, url: str, api: int, number: int, stop: Path) -> None:
    """One client: one connection, one request at a time, until STOP or its API is gone."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        i = 0
        while not stop.exists():
            value = float(number * PER_CLIENT + i)
            i += 1
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                "data": [value, 1.0, 2.0, 3.0]}]}
            recorder.sent += 1
            sent = time.monotonic()
            line: dict[str, Any] = {"api": api, "client": number, "value": value, "sent": sent}
            try:
                response = await client.post(f"{url}/v2/models/echo/infer", json=body)
            except httpx.HTTPError as exc:
                recorder.write({**line, "done": time.monotonic(), "status": 0,
                                "error": type(exc).__name__})
                return
            line.update(done=time.monotonic(), status=response.status_code)
            if response.status_code == 200:
                outputs = {o["name"]: o["data"] for o in response.json()["outputs"]}
                line["own"] = outputs["y"][0] == value * 2
            else:
                line["error"] = response.text[:200]
            recorder.write(line)


async def run(args: argparse.Namespace) -> None:
    await wait_ready(args.urls)
    recorder = Recorder(args.out)
    recorder.write({"ready": time.monotonic()})
    flusher = asyncio.create_task(recorder.flush_every(0.1))
    await asyncio.gather(*(client_loop(recorder, url, api, api * args.clients + c, args.stop)
                           for api, url in enumerate(args.urls) for c in range(args.clients)))
    flusher.cancel()
    recorder.write({"sent": recorder.sent, "end": time.monotonic()})
    recorder.file.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("stop", type=Path)
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--clients", type=int, default=4)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
