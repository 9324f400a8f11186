"""What the API knows about its models' workers: a cached view of their heartbeats.

A background task reads every model's heartbeat hash once per interval; probes and the
infer path read the cached view, so neither costs a Redis round trip.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from api.dispatch_port import DispatchPort
from api.periodic import Periodic
from batching.keys import Keys
from batching.redis_errors import REDIS_FAILED

log = logging.getLogger(__name__)

FORGET_AFTER_S = 60.0
SERVED_WITHIN_S = 30.0
"""A model with any heartbeat this recent still takes requests: a hung or restarting
process is being replaced, so requests queue for it rather than fail with 503."""
"""Heartbeats older than this are deleted: their process is long gone."""


@dataclass(slots=True)
class ModelWorkers:
    ready: int = 0
    alive: int = 0
    """Processes that will serve (loading, ready, restarting) seen within SERVED_WITHIN_S."""
    states: list[dict[str, Any]] = field(default_factory=list)
    failed: int = 0
    """Fresh heartbeats of slots their supervisor marked failed (the model did not load)."""
    failed_at: float = 0.0
    """Epoch seconds when the newest of them failed."""
    reason: str = ""
    """Why the newest of them failed, as its supervisor reported it."""
    configs: set[str] = field(default_factory=set)
    """The configuration digests the ready processes run (batching.repository_scan)."""
    shm: set[str | None] = field(default_factory=set)
    """The shared-memory tokens (batching/tensor_arena.py) of the processes that will
    serve; None for one that gave none."""


class WorkerWatch:
    def __init__(self, dispatcher: DispatchPort, keys: Keys, models: Collection[str],
                 interval_s: float, stale_s: float, broken: Collection[str] = ()) -> None:
        """``models`` is read live (the API's registry): loads and unloads show up here.
        ``broken``, read live too, holds the model folders whose configuration failed."""
        self._dispatcher = dispatcher
        self._keys = keys
        self._models = models
        self._broken = broken
        self._stale_s = stale_s
        self.view: dict[str, ModelWorkers] = {m: ModelWorkers() for m in models}
        self._served_at: dict[str, float] = {}
        """When each model last had a serving worker (monotonic seconds)."""
        self._loop = Periodic("conveyor-worker-watch", interval_s, self.refresh)

    async def start(self) -> None:
        await self.refresh()
        self._loop.start()

    async def close(self) -> None:
        await self._loop.close()

    def model_ready(self, model: str) -> bool:
        return self._dispatcher.redis_ok and self.view.get(model, ModelWorkers()).ready > 0

    def ready_with(self, model: str, digest: str) -> bool:
        """Some process runs the model, ready, with the configuration of ``digest`` (and
        none runs another: a reload has replaced them all)."""
        return self.model_ready(model) and self.view[model].configs == {digest}

    def model_served(self, model: str) -> bool:
        """Some worker process served the model lately, even if it is loading or being
        replaced now: requests then queue for the replacement rather than fail."""
        if self.view.get(model, ModelWorkers()).alive > 0:
            return True
        return time.monotonic() - self._served_at.get(model, -SERVED_WITHIN_S) < SERVED_WITHIN_S

    def shares_memory(self, model: str, token: str) -> bool:
        """Every process that will serve ``model`` sees the shared memory of ``token``."""
        return self.view.get(model, ModelWorkers()).shm == {token}

    def failure(self, model: str) -> tuple[float, str] | None:
        """(when, why) a worker reported the model failed to load, while no process of it
        is ready; None otherwise."""
        workers = self.view.get(model, ModelWorkers())
        if workers.ready or not workers.failed:
            return None
        return workers.failed_at, workers.reason

    def server_ready(self) -> bool:
        """Triton's ``--strict-readiness=false``: Redis answers, the repository holds a
        model, and every loaded model is ready or has explicitly failed (its configuration
        is invalid, or its worker reported that it failed to load)."""
        return (self._dispatcher.redis_ok and bool(self._models or self._broken)
                and all(self.model_ready(m) or self.failure(m) is not None
                        for m in self._models))

    async def refresh(self) -> None:
        redis = self._dispatcher.redis
        models = list(self._models)
        try:
            pipe = redis.pipeline(transaction=False)
            for model in models:
                pipe.hgetall(self._keys.workers(model))
            results = await pipe.execute()
        except REDIS_FAILED as exc:
            self._dispatcher.redis_ok = False
            log.debug("heartbeat refresh failed: %s", exc)
            return
        now = time.time()
        stale: list[tuple[str, bytes]] = []
        for model, raw in zip(models, results, strict=True):
            workers = ModelWorkers()
            for consumer, beat in raw.items():
                state = json.loads(beat)
                state.setdefault("consumer", consumer.decode())  # a slot's beat names none
                age = now - float(state.get("ts", 0))
                if age > FORGET_AFTER_S:
                    stale.append((model, consumer))
                if age <= SERVED_WITHIN_S and state.get("state") != "failed":
                    workers.alive += 1
                    workers.shm.add(state.get("shm"))
                if age <= self._stale_s:
                    workers.ready += state.get("state") == "ready"
                    if state.get("state") == "ready":
                        workers.configs.add(str(state.get("config", "")))
                    workers.states.append(state)
                    if state.get("state") == "failed":
                        workers.failed += 1
                        since = float(state.get("since", 0))
                        if since >= workers.failed_at:
                            workers.failed_at = since
                            workers.reason = str(state.get("reason") or "it failed to load")
            self.view[model] = workers
            if workers.alive:
                self._served_at[model] = time.monotonic()
        if stale:
            pipe = redis.pipeline(transaction=False)
            for model, consumer in stale:
                pipe.hdel(self._keys.workers(model), consumer)
            await pipe.execute()
