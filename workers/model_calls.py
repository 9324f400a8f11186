"""The inference process's client for calls to other models from ``predict`` (batching/bls.py).

A call is admitted as the API admits a request (``admit_many.lua``: the called model's
stream of the call's priority, one of its partitions in turn, against its row limit) and
answered onto this process's own reply list (``Keys.reply``), popped by whichever waiting
call holds the pop: the calls of several threads (``async_infer``) share the list. The
called model's configuration is read from the repository, as the inference process reads
its own, again after :data:`CONFIG_TTL_S`.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy.typing as npt
import redis

from batching.bls import Arrays, call_request
from batching.config import ConfigError, ModelConfig
from batching.envelope import Reply, Request
from batching.errors import (
    ConveyorError,
    DeadlineExceeded,
    InvalidInput,
    ModelFailure,
    ModelNotFound,
    Overloaded,
    Unavailable,
    call_failed,
)
from batching.keys import Keys
from batching.lua import script
from batching.names import require_folder
from batching.partitions import Spread
from batching.redis_errors import REDIS_UNREACHABLE
from batching.redis_topology import sync_redis
from batching.repository_scan import load_model_config
from batching.settings import Settings

ADMIT = script("admit_many")
POP_S = 1.0
"""Longest pop of the reply list: a waiting call looks at its deadline at least this often."""
CONFIG_TTL_S = 5.0
"""How long a called model's configuration is used before it is read again."""
REPLY_BATCH = 256

Pop = Callable[[float], list[bytes]]
"""Pops encoded replies off the reply list, waiting at most the seconds given."""


class ReplyBox:
    """Replies to the calls in flight; one waiting call pops at a time, for all of them."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._arrived: dict[str, Reply] = {}
        self._waiting: set[str] = set()
        self._popping = False

    def expect(self, request_id: str) -> None:
        """Keep ``request_id``'s reply from now: called before the request is sent, so a
        reply another waiting call pops before this one waits is not dropped."""
        with self._changed:
            self._waiting.add(request_id)

    def forget(self, request_id: str) -> None:
        """Stop keeping ``request_id``'s reply (its request was never sent)."""
        with self._changed:
            self._waiting.discard(request_id)
            self._arrived.pop(request_id, None)

    def wait(self, pop: Pop, request_id: str, deadline_ms: int) -> Reply:
        """The reply to ``request_id`` (:meth:`expect` ed); :class:`DeadlineExceeded` at
        ``deadline_ms``."""
        with self._changed:
            try:
                while request_id not in self._arrived:
                    left = deadline_ms / 1000.0 - time.time()
                    if left <= 0:
                        raise DeadlineExceeded(f"no answer within the batch's deadline "
                                               f"(call {request_id})")
                    if self._popping:
                        self._changed.wait(left)
                    else:
                        self._pop(pop, max(0.001, min(left, POP_S)))
                return self._arrived.pop(request_id)
            finally:
                self._waiting.discard(request_id)

    def _pop(self, pop: Pop, wait_s: float) -> None:
        """Pop once with the lock released; keep the replies someone waits for."""
        self._popping = True
        blobs: list[bytes] = []
        self._changed.release()
        try:
            blobs = pop(wait_s)
        finally:
            self._changed.acquire()
            self._popping = False
            for blob in blobs:
                reply = Reply.decode(blob)
                if reply.id in self._waiting:  # else its call gave up already
                    self._arrived[reply.id] = reply
            self._changed.notify_all()


class ModelCalls:
    """Makes the calls of this process's models (:class:`batching.bls.Caller`)."""

    def __init__(self, settings: Settings, client: redis.Redis | None = None) -> None:
        self._keys = Keys(settings.key_prefix)
        self._root = Path(settings.model_repository)
        self._redis = client or sync_redis(settings.redis_url, socket_connect_timeout=1.0,
                                           socket_timeout=POP_S + 5)
        self.reply_key = self._keys.reply(
            f"calls-{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}")
        self._admit = self._redis.register_script(ADMIT.text)
        self._ids = itertools.count(1)
        self._spread = Spread()
        self._box = ReplyBox()
        self._configs: dict[str, tuple[float, ModelConfig]] = {}

    def call(self, model: str, inputs: Mapping[str, npt.NDArray[Any]], deadline_ms: int,
             priority: int) -> Arrays:
        """Run ``inputs`` through ``model`` by ``deadline_ms``; raises
        :class:`ModelCallFailed` (of the error's own type) naming ``model``. A call the
        calling model got wrong (an unknown model, inputs off its signature) is a
        :class:`ModelFailure` of the caller, not its client's error."""
        now_ms = time.time() * 1000.0
        try:
            config = self._config(model)
            request = call_request(config, inputs, format(next(self._ids), "x"),
                                   self.reply_key, deadline_ms,
                                   priority or config.queue.default_priority, now_ms)
        except (ConfigError, ModelNotFound, InvalidInput) as exc:
            raise call_failed(model, ModelFailure.code, f"it cannot be called: {exc}") from exc
        try:
            if deadline_ms <= now_ms:
                raise DeadlineExceeded("the batch's deadline passed before the call")
            self._box.expect(request.id)
            try:
                self._enter(config, request)
            except BaseException:
                self._box.forget(request.id)
                raise
            reply = self._box.wait(self._pop, request.id, deadline_ms)
        except ConveyorError as exc:
            raise call_failed(model, exc.code, exc.message) from exc
        except REDIS_UNREACHABLE as exc:
            raise call_failed(model, Unavailable.code, f"Redis is unreachable: {exc}") from exc
        if not reply.ok:
            raise call_failed(model, reply.error_code, reply.error)
        return {t.name: t.array() for t in reply.outputs}

    def _config(self, model: str) -> ModelConfig:
        now = time.monotonic()
        held = self._configs.get(model)
        if held is not None and now < held[0]:
            return held[1]
        config = load_model_config(require_folder(self._root, model))
        self._configs[model] = (now + CONFIG_TTL_S, config)
        return config

    def _enter(self, config: ModelConfig, request: Request) -> None:
        """Admit ``request`` into its model's stream, or raise :class:`Overloaded`."""
        part = self._spread.pick(config.name, config.queue.partitions)
        rows_key = self._keys.rows_waiting(config.name, part)
        limit = config.queue.partition_rows
        [(waiting, _)] = self._admit(
            keys=[rows_key, self._keys.queue(config.name, request.prio, part)],
            args=[limit, request.rows, request.encode()])
        if waiting < 0:
            raise Overloaded(f"Exceeds maximum queue size: {-waiting - 1} rows waiting, "
                             f"limit {limit} (max_queue_rows)")

    def _pop(self, wait_s: float) -> list[bytes]:
        popped: Any = self._redis.blmpop(wait_s, 1, self.reply_key, direction="LEFT",
                                         count=REPLY_BATCH)
        return list(popped[1]) if popped else []


@functools.cache
def model_calls() -> ModelCalls:
    """This process's client, made at its first call."""
    return ModelCalls(Settings())


class DeferredCalls:
    """The :class:`batching.bls.Caller` of every batch: this process's :class:`ModelCalls`,
    made only once a model calls."""

    def call(self, model: str, inputs: Mapping[str, npt.NDArray[Any]], deadline_ms: int,
             priority: int) -> Arrays:
        return model_calls().call(model, inputs, deadline_ms, priority)
