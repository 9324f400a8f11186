"""The hot path's Redis connections, lean or on redis-py (``CONVEYOR_LEAN_REDIS``).

The per-request commands (admission and reply pops in the API, an inference process's
reads and answers) go through the lean client of :mod:`batching.resp` by default. With
``CONVEYOR_LEAN_REDIS=0`` they go through redis-py instead, behind the same interfaces:
a way to rule the lean client out when chasing a Redis problem, and to measure what it
saves (``python -m bench.lean_redis``). Either way the caller sees the same replies
(redis-py's response callbacks aside), :class:`RespError` for an error reply and
``ConnectionError`` for a lost connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.retry import Retry

from batching.redis_primary import PrimaryLocator
from batching.redis_topology import parse_topology, sync_redis
from batching.resp import (
    Command,
    Connection,
    LinkHandler,
    ReplyHandler,
    RespError,
    check,
    open_link,
    resolver,
)
from batching.resp_cluster import ClusterConnection, SlotRoutes, open_cluster_link

log = logging.getLogger(__name__)

P = TypeVar("P")


class BlockingLink(Protocol):
    """What an inference process asks of its hot-path connection."""

    splits: bool
    """Whether the commands of one write may go to different nodes, each applying its part
    on its own (a Redis Cluster): a write then orders nothing across nodes, and one part
    can fail while another is applied. Where one command must wait for another's success,
    the caller sends it once it has read the other's reply. False: one server applies a
    write's commands in order."""

    def execute(self, commands: Sequence[Command], spin_s: float = 0.0) -> list[Any]:
        """Send ``commands`` in one write and return their replies; an error reply raises
        :class:`RespError`. ``spin_s``: poll, not sleep, that long for the reply."""

    def send(self, commands: Sequence[Command], on_replies: ReplyHandler | None = None) -> None:
        """Send ``commands``; their replies go to ``on_replies`` (errors are logged when
        nobody takes them) by the next :meth:`execute` or :meth:`flush` at the latest."""

    def flush(self) -> None:
        """Read every outstanding reply of :meth:`send`."""

    def close(self) -> None: ...


class AsyncLink(Protocol[P]):
    """What the API's dispatcher asks of each of its two hot-path connections."""

    closed: asyncio.Future[None]
    """Done once the link is lost or aborted: the dispatcher then opens new ones."""

    def prepare(self, commands: Sequence[Command]) -> P:
        """``commands`` in the form :meth:`write` takes."""

    def write(self, prepared: P, handlers: list[LinkHandler]) -> None:
        """Send the commands; ``handlers`` (one per command) receive their replies, or
        the ``ConnectionError`` of a lost link."""

    def abort(self) -> None: ...


def blocking_link(url: str, timeout_s: float, lean: bool = True) -> BlockingLink:
    """An inference process's hot-path connection to the Redis at ``url`` (its primary,
    under Sentinel; each command's node, in a cluster)."""
    if not lean:
        return PipelineConnection(url, timeout_s)
    topology = parse_topology(url)
    if topology.kind == "cluster":
        return ClusterConnection(topology, timeout_s)
    locator = PrimaryLocator(topology)
    return Connection(locator.topology.node, timeout_s,
                      locate=locator.address if locator.watched else None)


LinkOpener = Callable[[], Awaitable[AsyncLink[Any]]]
"""Opens a new hot-path link for the API's dispatcher (raises ``OSError``,
:class:`RespError` or ``TimeoutError`` when it cannot)."""


def link_opener(url: str, client: aioredis.Redis, lean: bool = True) -> LinkOpener:
    """How the dispatcher opens its links to the Redis at ``url`` (its primary now, under
    Sentinel): lean ones, or pipelines on ``client`` (redis.asyncio)."""
    if not lean:
        return functools.partial(open_pipeline_link, client)
    topology = parse_topology(url)
    if topology.kind == "cluster":
        return functools.partial(open_cluster_link, topology, SlotRoutes(topology))
    locator = PrimaryLocator(topology)

    async def open_lean() -> AsyncLink[Any]:
        return await open_link(await locator.address_async(), primary=locator.watched)
    return open_lean


def _reply(value: Any) -> Any:
    """A reply from a redis-py pipeline as the lean client gives it: an error reply as a
    :class:`RespError` (redis-py drops the ``NOSCRIPT`` code the dispatcher looks for)."""
    if isinstance(value, NoScriptError):
        return RespError(f"NOSCRIPT {value}")
    if isinstance(value, ResponseError):
        return RespError(str(value))
    return value


class PipelineConnection:
    """:class:`batching.resp.Connection`'s interface on a redis-py pipeline: each
    :meth:`execute` or :meth:`send` is one pipeline, run at once (redis-py cannot defer
    replies, nor poll for them: ``spin_s`` is ignored). Like the lean client it does not
    retry: a lost connection raises ``ConnectionError`` and the caller backs off."""

    def __init__(self, url: str, timeout_s: float, connect_timeout_s: float = 1.0) -> None:
        self._redis = sync_redis(url, socket_timeout=timeout_s,
                                 socket_connect_timeout=connect_timeout_s,
                                 retry=Retry(NoBackoff(), 0))
        self.splits = parse_topology(url).kind == "cluster"
        """redis-py's cluster pipeline sends each node its part of a write on its own."""

    def execute(self, commands: Sequence[Command], spin_s: float = 0.0) -> list[Any]:
        replies = self._run(commands)
        for reply in replies:
            check(reply)
        return replies

    def call(self, *command: Any) -> Any:
        return self.execute([command])[0]

    def send(self, commands: Sequence[Command], on_replies: ReplyHandler | None = None) -> None:
        replies = self._run(commands)
        if on_replies is not None:
            on_replies(replies)
            return
        for reply in replies:
            if isinstance(reply, RespError):
                log.error("Redis refused a deferred command: %s", reply)

    def flush(self) -> None:
        """Nothing is outstanding: :meth:`send` read its replies."""

    def close(self) -> None:
        self._redis.close()

    def _run(self, commands: Sequence[Command]) -> list[Any]:
        pipe = self._redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)  # type: ignore[no-untyped-call]
        try:
            values = pipe.execute(raise_on_error=False)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise ConnectionError(f"lost the connection to Redis: {exc}") from exc
        return [_reply(value) for value in values]


class PipelineLink:
    """:class:`batching.resp.Link`'s part the dispatcher uses, on a redis.asyncio client:
    each :meth:`write` is one pipeline in a task of its own. A connection error closes
    the link (so the dispatcher reconnects, as it does when a lean link drops)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def prepare(self, commands: Sequence[Command]) -> tuple[Command, ...]:
        return tuple(commands)

    def write(self, prepared: tuple[Command, ...], handlers: list[LinkHandler]) -> None:
        if self.closed.done():
            error = ConnectionError("not connected to Redis")
            for handler in handlers:
                handler(error)
            return
        task = asyncio.get_running_loop().create_task(self._run(prepared, handlers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def abort(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._lost()

    async def execute(self, *commands: Command) -> list[Any]:
        """Send ``commands`` and await their replies; error replies raise."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in commands]
        self.write(self.prepare(commands), [resolver(f) for f in futures])
        return [check(reply) for reply in await asyncio.gather(*futures)]

    async def _run(self, commands: tuple[Command, ...], handlers: list[LinkHandler]) -> None:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = [_reply(value) for value in await pipe.execute(raise_on_error=False)]
        except (RedisError, OSError) as exc:
            self._lost()
            replies = [ConnectionError(f"lost the connection to Redis: {exc}")] * len(handlers)
        except asyncio.CancelledError:
            error = ConnectionError("lost the connection to Redis: aborted")
            for handler in handlers:
                handler(error)
            raise
        for handler, reply in zip(handlers, replies, strict=True):
            handler(reply)

    def _lost(self) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def open_pipeline_link(client: aioredis.Redis, timeout_s: float = 1.0) -> PipelineLink:
    """A :class:`PipelineLink` on ``client``, once Redis answers a ``PING``; raises
    ``ConnectionError`` (an ``OSError``) when it does not."""
    try:
        await asyncio.wait_for(client.ping(), timeout_s)
    except (RedisError, OSError) as exc:
        raise ConnectionError(f"Redis is unreachable: {exc}") from exc
    return PipelineLink(client)
