"""The API process's links to Redis for requests and replies.

Writes are coalesced: every request submitted during one event-loop tick goes out in
one write (16 at most). The requests of a write that go to one stream are admitted by one
call of a Lua script (batching/lua/admit_many.lua) that checks each in turn against the
model's rows waiting and its limit and appends it to the stream, atomically, so the
overload check costs no extra round trip and a rejected request writes nothing; a large
entry takes two steps instead, its bytes in a plain ``XADD`` (api/admission.py).
Replies come back on one list per API process (``cv:reply:{api_id}``), popped in bulk
on a second connection; each pop's reply resolves the requests' futures and sends the
next pop. A request whose waiter is cancelled (its client left: an HTTP hang-up, a
cancelled gRPC call) is withdrawn from its model's queue (batching/lua/withdraw.lua), so
the model never runs it. A request whose outputs may be large is offered a place for
them in this process (api/output_offers.py): its reply then names them instead of carrying
them. Both connections are lean RESP links (batching.resp), or redis.asyncio ones with
``CONVEYOR_LEAN_REDIS=0`` (batching.redis_links); redis-py serves every other Redis call of
the API.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from api.admission import (
    LARGE_ENTRY_BYTES,
    Pending,
    admit_command,
    append_command,
    reserve_command,
)
from api.admission import REQUEST_ADMIT as REQUEST_ADMIT
from api.admission import Admission as Admission
from api.lone_poll import LonePoll
from api.output_offers import OutputOffers
from batching.envelope import Reply, Request
from batching.errors import DeadlineExceeded, Overloaded, Unavailable
from batching.keys import GROUP, Keys
from batching.lua import script
from batching.redis_links import AsyncLink, link_opener
from batching.redis_topology import async_redis
from batching.resp import LinkHandler, RespError

log = logging.getLogger(__name__)

REPLY_BATCH = 1024
"""Replies popped per round trip."""
ADMIT_CHUNK = 16
"""Requests per admission write, at most: a tick that takes more writes every 16 at once.
One write per tick would hold the first requests of a tick from the worker until the last
is parsed; with many clients in a closed loop, the requests then move as one cohort, the
worker idle while the API parses and the API idle while the worker runs
(docs/data-path.md section 1)."""
POP_BLOCK_S = 1
POP_STALL_S = POP_BLOCK_S + 4
"""A pop unanswered this long means a hung Redis: both links are dropped and rebuilt."""
WITHDRAW = script("withdraw")


class Dispatcher:
    def __init__(self, redis_url: str, keys: Keys, busy_poll_s: float = 0.0,
                 lean: bool = True) -> None:
        """``lean``: admission and replies on lean RESP links (``CONVEYOR_LEAN_REDIS``);
        otherwise on redis.asyncio, through :attr:`redis`."""
        self.api_id = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.reply_key = keys.reply(self.api_id)
        self._keys = keys
        self._redis = async_redis(redis_url, socket_connect_timeout=0.5, socket_timeout=2.0)
        self._open = link_opener(redis_url, self._redis, lean)
        self._ids = itertools.count(1)
        self._waiting: dict[str, asyncio.Future[Reply]] = {}
        self._entry_ids: dict[asyncio.Future[Reply], bytes | str] = {}
        """Stream entry ids of admitted requests still waiting: what a withdrawal names."""
        self._outbox: list[Pending] = []
        self._appends: list[tuple[Pending, int]] = []
        """Large requests whose rows are reserved, to append in one write this tick."""
        self._pop_command = ("BLMPOP", POP_BLOCK_S, 1, self.reply_key, "LEFT", "COUNT",
                             REPLY_BATCH)
        self._pop_prepared: Any = None
        """The pop in the current reader's form (encoded once per lean link)."""
        self._writer: AsyncLink[Any] | None = None
        self._reader: AsyncLink[Any] | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._keeper: asyncio.Task[None] | None = None
        self.redis_ok = True
        self._lone = LonePoll(busy_poll_s, lambda: len(self._waiting))
        self.outputs: OutputOffers | None = None
        """Where the large outputs of the requests offered it come back by reference
        (api/output_offers.py); None: in the replies."""

    @property
    def redis(self) -> aioredis.Redis:
        """redis-py, for everything but admission and replies."""
        return self._redis

    def new_id(self) -> str:
        return format(next(self._ids), "x")

    async def start(self) -> None:
        self._keeper = asyncio.create_task(self._keep_linked(), name="conveyor-redis-links")

    async def close(self) -> None:
        self._lone.close()
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
        self._drop_links()
        self._fail_waiting(Unavailable("the API is shutting down"))
        try:
            await self._redis.aclose()
        except (RedisError, OSError) as exc:  # a slow or gone Redis must not stop the shutdown
            log.info("closing the Redis client: %s", exc)

    async def submit(self, admission: Admission, request: Request, timeout_s: float) -> Reply:
        """Admit ``request`` to its stream and wait for its reply until ``timeout_s``.

        Raises :class:`Overloaded` if the model's queue is full, :class:`Unavailable` if
        Redis is unreachable and :class:`DeadlineExceeded` when ``timeout_s`` passes.
        Cancelled (the client left), it withdraws the request before it re-raises.
        """
        if not self.redis_ok or self._writer is None:
            raise Unavailable("Redis is unreachable")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Reply] = loop.create_future()
        lone = not self._waiting
        if lone:  # tells the worker that the load is light: it may run the request on every
            request.params["lone"] = 1  # core and poll for the next one
        self._waiting[request.id] = fut
        if not self._outbox:
            loop.call_soon(self._flush)
        self._lone.submitted(admission.rows_key, lone)
        offer = (self.outputs.offer(admission.model, request, admission.rows)
                 if self.outputs is not None else None)
        self._outbox.append((admission, request.encode(), fut))
        if len(self._outbox) >= ADMIT_CHUNK:  # the worker starts on these while the rest parse
            self._flush()
        # A timer on the future itself: lighter than asyncio.wait_for's extra future.
        expiry = loop.call_later(max(timeout_s, 0.0), _expire, fut, timeout_s)
        try:
            reply = await fut
            if lone and reply.exec_ms > 0:
                self._lone.note_exec(admission.rows_key, reply.exec_ms / 1e3)
            if self.outputs is not None:
                self.outputs.resolve(offer, reply)
            return reply
        except asyncio.CancelledError:
            entry_id = self._entry_ids.get(fut)
            if entry_id is not None:  # else not admitted yet: _admitted withdraws it
                self._withdraw(admission, entry_id, request.deadline_ms)
            raise
        finally:
            expiry.cancel()
            self._waiting.pop(request.id, None)
            self._entry_ids.pop(fut, None)
            if offer is not None and self.outputs is not None:
                self.outputs.free(offer)

    def _withdraw(self, admission: Admission, entry_id: bytes | str, deadline_ms: int) -> None:
        """Take an admitted request back: deleted if no worker has read it yet, else
        marked for the worker holding it (batching/lua/withdraw.lua). Best effort: if
        Redis cannot be reached the worker runs it and nobody reads the answer."""
        if not admission.model or self._writer is None:
            return
        keys, model = self._keys, admission.model
        # The stats hash lives in partition 0's slot: another partition's withdrawal is
        # counted by a command of its own, once the script says it deleted the entry.
        counted = [keys.stats(model)] if admission.partition == 0 else []
        handler = _withdrawn if counted else partial(self._count_withdrawn, model)
        self._writer.write(self._writer.prepare([(
            "EVAL", WITHDRAW.text, 3 + len(counted), admission.rows_key, admission.stream,
            keys.withdrawn(model, admission.partition), *counted, GROUP, entry_id,
            admission.rows, deadline_ms, int(time.time() * 1000))]), [handler])

    def _count_withdrawn(self, model: str, reply: Any) -> None:
        """A withdrawal from a partition other than 0 answered: count a deleted entry."""
        _withdrawn(reply)
        if reply == 1 and self._writer is not None:
            self._writer.write(self._writer.prepare([
                ("HINCRBY", self._keys.stats(model), "withdrawn_count", 1)]), [_withdrawn])

    def _flush(self) -> None:
        # A request cancelled in its tick (its client left) is not admitted at all: admitting
        # it would only have it withdrawn again at once.
        batch = [item for item in self._outbox if not item[2].done()]
        self._outbox = []
        if not batch:
            return
        if self._writer is None:
            error = ConnectionError("not connected to Redis")
            for admission, data, fut in batch:
                self._admitted(admission, data, fut, error)
            return
        groups: dict[tuple[str, str, int], list[Pending]] = {}
        large: list[Pending] = []
        for item in batch:
            a = item[0]
            if len(item[1]) > LARGE_ENTRY_BYTES:
                large.append(item)
            else:
                groups.setdefault((a.stream, a.rows_key, a.max_rows), []).append(item)
        handlers: list[LinkHandler] = [partial(self._group_admitted, g) for g in groups.values()]
        handlers += [partial(self._reserved, item) for item in large]
        writer = self._writer
        writer.write(writer.prepare(
            [admit_command("EVALSHA", REQUEST_ADMIT.sha, group) for group in groups.values()]
            + [reserve_command(a) for a, _, _ in large]), handlers)

    def _reserved(self, item: Pending, reply: Any) -> None:
        """A large request's rows reserved (or refused): append its entry. Should the API
        die before the ``XADD``, the rows stay counted without an entry until the
        inference processes' reconciler (workers/reconcile.py) sets the counter to the
        streams' rows."""
        admission, data, fut = item
        if not isinstance(reply, int) or reply < 0:
            self._admitted(admission, data, fut, [reply, b""] if isinstance(reply, int) else reply)
        elif fut.done() or self._writer is None:  # nobody waits, or the link is gone
            self._give_back(admission)
            self._admitted(admission, data, fut, ConnectionError("lost the connection"))
        else:
            if not self._appends:
                asyncio.get_running_loop().call_soon(self._append)
            self._appends.append((item, reply))

    def _append(self) -> None:
        """The entries of the large requests reserved this tick, in one write."""
        appends, self._appends = self._appends, []
        if self._writer is None:
            for item, _ in appends:
                self._appended(item, 0, ConnectionError("lost the connection"))
            return
        self._writer.write(self._writer.prepare([append_command(a, data)
                                                 for (a, data, _), _ in appends]),
                           [partial(self._appended, item, waiting) for item, waiting in appends])

    def _appended(self, item: Pending, waiting: int, reply: Any) -> None:
        admission, data, fut = item
        if isinstance(reply, OSError | RespError):
            self._give_back(admission)
            self._admitted(admission, data, fut, reply)
        else:
            self._admitted(admission, data, fut, [waiting, reply])

    def _give_back(self, admission: Admission) -> None:
        """Release rows reserved for an entry that was never appended (best effort: the
        reconciler corrects a counter this misses)."""
        if self._writer is not None:
            self._writer.write(self._writer.prepare([
                ("DECRBY", admission.rows_key, admission.rows)]), [_given_back])

    def _group_admitted(self, group: list[Pending], reply: Any) -> None:
        """One stream's share of a write admitted: each request's own answer in turn."""
        if (isinstance(reply, RespError) and str(reply).startswith("NOSCRIPT")
                and self._writer is not None):
            # A new or restarted Redis: EVAL sends the script along and caches it again.
            # Not for requests already answered (their deadline passed): nobody would read
            # their replies, and their entries would hold rows of the queue until a worker
            # got to them.
            live = [item for item in group if not item[2].done()]
            if live:
                self._writer.write(self._writer.prepare([admit_command("EVAL", REQUEST_ADMIT.text, live)]),
                                   [partial(self._group_admitted, live)])
            return
        if isinstance(reply, list) and len(reply) == len(group):
            for (admission, data, fut), one in zip(group, reply, strict=True):
                self._admitted(admission, data, fut, one)
            return
        error = reply if isinstance(reply, OSError | RespError) else RespError(
            f"admission answered {reply!r} for {len(group)} requests")
        for admission, data, fut in group:
            self._admitted(admission, data, fut, error)

    def _admitted(self, admission: Admission, data: bytes, fut: asyncio.Future[Reply],
                  reply: Any) -> None:
        if fut.done():
            if fut.cancelled() and isinstance(reply, list) and reply[0] >= 0:
                self._withdraw(admission, reply[1], Request.decode(data).deadline_ms)
            return
        if isinstance(reply, OSError | RespError):
            self._mark_down(reply)
            fut.set_exception(Unavailable(f"Redis is unreachable: {reply}"))
        elif reply[0] >= 0:
            self._entry_ids[fut] = reply[1]
        else:
            fut.set_exception(Overloaded(
                f"Exceeds maximum queue size: {-reply[0] - 1} rows waiting, limit "
                f"{admission.max_rows} (max_queue_rows)"))

    def _mark_down(self, exc: BaseException) -> None:
        if self.redis_ok:
            log.warning("Redis unreachable: %s", exc)
        self.redis_ok = False

    async def _keep_linked(self) -> None:
        """Hold both links open: connect, pop replies until either link drops, answer
        the waiting requests, reconnect with backoff."""
        backoff = 0.05
        while True:
            try:
                self._writer = await self._open()
                self._reader = await self._open()
                self._pop_prepared = self._reader.prepare([self._pop_command])
            except (OSError, RespError, TimeoutError) as exc:
                self._drop_links()
                self._mark_down(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05
            if not self.redis_ok:
                log.info("Redis reachable again")
            self.redis_ok = True
            self._pop()
            await asyncio.wait([self._writer.closed, self._reader.closed],
                               return_when=asyncio.FIRST_COMPLETED)
            self._drop_links()
            self._mark_down(ConnectionError("lost the connection"))
            self._fail_waiting(Unavailable("lost the connection to Redis"))

    def _drop_links(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
        for link in (self._writer, self._reader):
            if link is not None:
                link.abort()
        self._writer = self._reader = None

    def _pop(self, on: AsyncLink[Any] | None = None) -> None:
        """Send the next pop, on the current reader (only if that is still ``on``)."""
        if self._reader is None or on not in (None, self._reader):
            return
        self._stall = asyncio.get_running_loop().call_later(POP_STALL_S, self._stalled)
        self._reader.write(self._pop_prepared, [self._popped])

    def _stalled(self) -> None:
        log.warning("Redis did not answer a pop in %d s; reconnecting", POP_STALL_S)
        if self._reader is not None:
            self._reader.abort()

    def _popped(self, reply: Any) -> None:
        if self._stall is not None:
            self._stall.cancel()
        if isinstance(reply, OSError):
            return  # the keeper reconnects
        if isinstance(reply, RespError):
            self._mark_down(reply)
            asyncio.get_running_loop().call_later(0.1, self._pop, self._reader)
            return
        if not self.redis_ok:
            log.info("Redis reachable again")
        self.redis_ok = True
        self._pop()
        if reply:
            self._lone.replied()
        for data in reply[1] if reply else ():
            try:
                self._resolve(Reply.decode(data))
            except (ValueError, TypeError, KeyError) as exc:
                log.error("dropping an unreadable reply: %s", exc)

    def _fail_waiting(self, error: Unavailable) -> None:
        """Redis went away: whether waiting requests will ever be answered is unknown, so
        answer them now rather than at their deadlines."""
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(error)

    def _resolve(self, reply: Reply) -> None:
        fut = self._waiting.get(reply.id)
        if fut is not None and not fut.done():
            fut.set_result(reply)


def _withdrawn(reply: Any) -> None:
    if isinstance(reply, OSError | RespError):
        log.warning("could not withdraw a request whose client left: %s", reply)


def _given_back(reply: Any) -> None:
    if isinstance(reply, OSError | RespError):
        log.warning("could not release the rows of a request never appended: %s", reply)


def _expire(fut: asyncio.Future[Reply], timeout_s: float) -> None:
    if not fut.done():
        fut.set_exception(DeadlineExceeded(
            f"no result within the request's deadline ({timeout_s * 1000:.0f} ms)"))
