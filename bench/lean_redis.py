"""Per-command cost of the lean Redis client against redis-py, on the hot path's commands.

Usage: python -m bench.lean_redis [--iterations N] [--rounds R]

Starts its own redis-server on a free port and runs, in this process, the two patterns the
lean client serves (docs/data-path.md section 7), once per client:

- worker: an inference process's read and answer: ``XREADGROUP`` of one entry, then its
  answer (``RPUSH``, ``EXPIRE``, ``EVAL`` release.lua) sent, read with the next read;
  lean :class:`batching.resp.Connection` against the redis-py pipeline that
  ``CONVEYOR_LEAN_REDIS=0`` puts there (:class:`batching.redis_links.PipelineConnection`).
- API: one request's admission (``EVALSHA`` admit_many.lua, one request a call) and one
  reply pop (``BLMPOP``), as the dispatcher sends them; lean :class:`batching.resp.Link`
  against plain redis.asyncio commands and the redis.asyncio pipelines
  ``CONVEYOR_LEAN_REDIS=0`` uses (:class:`batching.redis_links.PipelineLink`).

The cost is this process's CPU time (Redis runs in its own process), per command; the
wall time per command is shown too. Each client runs ``--rounds`` times, interleaved, and
the cheapest round counts, which keeps other load on the machine out of the figures.
Run it again after each redis-py upgrade: the lean client is worth keeping only while the
ratio stays large.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from batching.lua import script
from batching.redis_links import AsyncLink, BlockingLink, PipelineConnection, PipelineLink
from batching.resp import Address, Connection, open_link

GROUP = "bench"
STREAM = "bench:q"
ROWS = "bench:rows"
REPLIES = "bench:replies"
PAYLOAD = b"x" * 200
"""About a small request's envelope."""
WORKER_COMMANDS = 4
API_COMMANDS = 2


@dataclass(frozen=True, slots=True)
class Cost:
    cpu_us: float
    wall_us: float


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH")
    port = free_port()
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(folder)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            with redis.Redis.from_url(url) as client:
                client.ping()
            return server, url
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.05)


def measure(run: Callable[[], None], commands: int) -> Cost:
    cpu, wall = time.process_time(), time.perf_counter()
    run()
    return Cost((time.process_time() - cpu) / commands * 1e6,
                (time.perf_counter() - wall) / commands * 1e6)


def fill_stream(url: str, entries: int) -> None:
    with redis.Redis.from_url(url) as client:
        client.delete(STREAM, ROWS, REPLIES)
        client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        pipe = client.pipeline(transaction=False)
        for _ in range(entries):
            pipe.xadd(STREAM, {"d": PAYLOAD, "r": 1})
        pipe.incrby(ROWS, entries)
        pipe.execute()


def fill_replies(url: str, replies: int) -> None:
    with redis.Redis.from_url(url) as client:
        client.delete(STREAM, ROWS, REPLIES)
        client.script_load(script("admit_many").text)
        for start in range(0, replies, 1000):
            client.rpush(REPLIES, *[PAYLOAD] * min(1000, replies - start))


def worker_round(link: BlockingLink, iterations: int) -> None:
    """What ModelStreams.read and .answer send for a batch of one request."""
    release = script("release").text.encode()
    read = ("XREADGROUP", "GROUP", GROUP, "c1", "COUNT", 1, "STREAMS", STREAM, ">")
    for _ in range(iterations):
        entry_id = link.execute([read])[0][0][1][0][0]
        link.send([("RPUSH", REPLIES, PAYLOAD), ("EXPIRE", REPLIES, 300),
                   ("EVAL", release, 2, ROWS, STREAM, GROUP, entry_id, 1)])
    link.flush()


def admit(rows: int) -> tuple[Any, ...]:
    return ("EVALSHA", script("admit_many").sha, 2, ROWS, STREAM, 1 << 40, rows, PAYLOAD)


POP = ("BLMPOP", 1, 1, REPLIES, "LEFT", "COUNT", 1)


async def link_round(link: AsyncLink[Any], iterations: int) -> None:
    """The dispatcher's way: each command written with a handler that settles a future."""
    loop = asyncio.get_running_loop()
    pop = link.prepare([POP])
    for _ in range(iterations):
        admitted: asyncio.Future[Any] = loop.create_future()
        link.write(link.prepare([admit(1)]), [admitted.set_result])
        popped: asyncio.Future[Any] = loop.create_future()
        link.write(pop, [popped.set_result])
        await admitted
        await popped


async def redis_py_round(client: aioredis.Redis, iterations: int) -> None:
    for _ in range(iterations):
        await client.evalsha(script("admit_many").sha, 2, ROWS, STREAM, 1 << 40, 1, PAYLOAD)
        await client.blmpop(1, 1, REPLIES, direction="LEFT", count=1)


async def api_round(url: str, kind: str, iterations: int) -> None:
    client = aioredis.Redis.from_url(url, socket_timeout=5)
    link: AsyncLink[Any] | None = None
    try:
        if kind == "lean":
            link = await open_link(Address.from_url(url))
        elif kind == "pipeline":
            await client.ping()
            link = PipelineLink(client)
        if link is None:
            await redis_py_round(client, iterations)
        else:
            await link_round(link, iterations)
    finally:
        if link is not None:
            link.abort()
        await client.aclose()


def worker_cost(url: str, link: BlockingLink, iterations: int) -> Cost:
    try:
        fill_stream(url, iterations)
        return measure(lambda: worker_round(link, iterations), iterations * WORKER_COMMANDS)
    finally:
        link.close()


def api_cost(url: str, kind: str, iterations: int) -> Cost:
    fill_replies(url, iterations)
    return measure(lambda: asyncio.run(api_round(url, kind, iterations)),
                   iterations * API_COMMANDS)


def bench(url: str, iterations: int, rounds: int) -> list[tuple[str, str, Cost]]:
    """Each client ``rounds`` times, interleaved; the cheapest round of each, lean first."""
    best: dict[tuple[str, str], Cost] = {}
    for _ in range(rounds):
        costs = {
            ("worker: read + answer", "lean Connection"):
                worker_cost(url, Connection(Address.from_url(url), 5.0), iterations),
            ("worker: read + answer", "redis-py pipeline (PipelineConnection)"):
                worker_cost(url, PipelineConnection(url, 5.0), iterations),
            **{("API: admit + pop", name): api_cost(url, kind, iterations) for name, kind in (
                ("lean Link", "lean"), ("redis.asyncio commands", "commands"),
                ("redis.asyncio pipelines (PipelineLink)", "pipeline"))},
        }
        for key, cost in costs.items():
            if key not in best or cost.cpu_us < best[key].cpu_us:
                best[key] = cost
    return [(pattern, name, cost) for (pattern, name), cost in best.items()]


def table(results: list[tuple[str, str, Cost]]) -> str:
    lines = ["| pattern | client | CPU µs / command | wall µs / command | CPU ratio |",
             "|---|---|---:|---:|---:|"]
    base: dict[str, float] = {}
    for pattern, name, cost in results:
        base.setdefault(pattern, cost.cpu_us)  # the lean client comes first
        lines.append(f"| {pattern} | {name} | {cost.cpu_us:.1f} | {cost.wall_us:.1f} | "
                     f"{cost.cpu_us / base[pattern]:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=2000,
                        help="requests per client and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lean-redis-") as folder:
        server, url = start_redis(Path(folder))
        try:
            results = bench(url, args.iterations, args.rounds)
        finally:
            server.terminate()
            server.wait(10)
    print(f"redis-py {redis.__version__}, {args.iterations} requests per client, "
          f"best of {args.rounds} rounds")
    print(table(results))


if __name__ == "__main__":
    main()
