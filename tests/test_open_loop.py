"""bench.open_loop: the light open-loop generator, against a tiny asyncio HTTP server."""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from bench.open_loop import Outcome, on_off, poisson, pooled, run


def test_poisson_has_the_rate_and_stays_in_the_window() -> None:
    times = poisson(2000.0, 5.0, seed=3)
    assert abs(len(times) / 5.0 - 2000.0) < 100.0
    assert times == sorted(times) and times[0] > 0.0 and times[-1] < 5.0


def test_on_off_keeps_the_mean_and_is_silent_when_off() -> None:
    times = on_off(1000.0, 10.0, on_s=0.05, off_s=0.15, seed=1)
    assert abs(len(times) / 10.0 - 1000.0) < 80.0
    assert all((t % 0.2) < 0.05 + 1e-9 for t in times)
    assert times == sorted(times)


async def _serve(delay_s: float, status: int = 200) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                await asyncio.sleep(delay_s)
                body = b'{"ok":1}'
                writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_every_request_is_answered_and_timed_from_its_schedule() -> None:
    async def main() -> None:
        server, port = await _serve(0.02)
        async with server:
            times = poisson(300.0, 1.0, seed=5)
            out = await run("127.0.0.1", port, "/x", b"{}", times, 32, warmup_s=0.2)
        assert out.sent == sum(1 for t in times if t >= 0.2)
        assert len(out.statuses) == out.sent and out.lost == 0
        assert set(out.statuses) == {200}
        assert statistics.median(out.latencies_ms) >= 20.0
        assert out.good(1000.0) == out.sent and out.good(5.0) == 0
        assert 0.0 < out.cpu_share < 1.0

    asyncio.run(main())


def test_a_slow_server_shows_as_extra_connections_not_lost_requests() -> None:
    async def main() -> None:
        server, port = await _serve(0.1, status=503)
        async with server:
            out = await run("127.0.0.1", port, "/x", b"{}", poisson(200.0, 0.5, seed=2), 2)
        assert out.extra_connections > 0
        assert out.count(503) == out.sent and out.lost == 0

    asyncio.run(main())


def test_a_slow_new_connection_delays_its_own_request_not_the_ones_after_it() -> None:
    """Past the connections opened in advance, a request goes on a new one; opening it may
    take a while (a SYN retransmitted after a full accept queue: 1 s). The sends after it
    stay on time, and its own latency counts the wait from its schedule."""
    async def main() -> None:
        server, port = await _serve(0.1)
        loop = asyncio.get_running_loop()
        real = loop.create_connection
        opened = 0

        async def slow(*args: Any, **kwargs: Any) -> Any:
            nonlocal opened
            opened += 1
            if opened > 2:  # the two opened in advance are quick
                await asyncio.sleep(0.3)
            return await real(*args, **kwargs)

        loop.create_connection = slow  # type: ignore[method-assign]
        async with server:
            out = await run("127.0.0.1", port, "/x", b"{}", poisson(100.0, 1.0, seed=4), 2)
        assert out.extra_connections > 0
        assert out.count(200) == out.sent and out.lost == 0
        assert out.lag_p99_ms() < 100.0, out.lag_p99_ms()
        assert max(out.latencies_ms) >= 300.0

    asyncio.run(main())


def test_pooled_runs_keep_every_request() -> None:
    one = Outcome(latencies_ms=[1.0, 60.0], statuses=[200, 200], lost=1, sent=3,
                  lag_ms=[0.1], cpu_share=0.1, extra_connections=1)
    two = Outcome(latencies_ms=[2.0], statuses=[504], sent=1, lag_ms=[9.0], cpu_share=0.3)
    both = pooled([one, two])
    assert both.statuses == [200, 200, 504] and both.latencies_ms == [1.0, 60.0, 2.0]
    assert (both.sent, both.lost, both.extra_connections) == (4, 1, 1)
    assert both.good(50.0) == 1 and both.lag_ms == [0.1, 9.0]
    assert abs(both.cpu_share - 0.2) < 1e-9
