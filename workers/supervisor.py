"""Supervises one inference process per model instance, from inside the Celery worker.

Processes are started with ``spawn``. One that dies is replaced after an exponential
back-off (reset once a replacement has run for a while); the Celery main process never
exits because a model failed, so a broken model cannot crash-loop the pod.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import redis

from batching.config import ModelConfig
from batching.keys import Keys
from batching.repository import load_repository
from batching.settings import Settings
from workers.inference import serve

log = logging.getLogger("conveyor.supervisor")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
HEALTHY_AFTER_S = 30.0
"""A process that has lived this long resets its slot's back-off."""
STOP_GRACE_S = 10.0


@dataclass(slots=True)
class Slot:
    """One model instance: the process now serving it and its restart history."""

    model: str
    device: str
    index: int
    process: BaseProcess | None = None
    started: float = 0.0
    restarts: int = 0
    backoff_s: float = BACKOFF_START_S
    next_start: float = 0.0
    pids: list[int] = field(default_factory=list)


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.models: dict[str, ModelConfig] = load_repository(
            settings.model_repository, settings.model_filter() or None)
        self.slots = [Slot(name, group.device, i)
                      for name, config in self.models.items()
                      for group in config.instances
                      for i in range(group.count)]
        self._ctx = multiprocessing.get_context("spawn")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="conveyor-supervisor",
                                        daemon=True)
        self._redis = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=1.0,
                                           socket_timeout=2.0)

    def start(self) -> None:
        log.info("supervising %d inference processes for %s", len(self.slots), sorted(self.models))
        for slot in self.slots:
            self._spawn(slot)
        self._thread.start()

    def stop(self) -> None:
        """SIGTERM every process (each finishes its batch and acks), then wait, then kill."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        for slot in self.slots:
            if slot.process is not None and slot.process.is_alive():
                slot.process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for slot in self.slots:
            if slot.process is not None:
                slot.process.join(timeout=max(0.0, deadline - time.monotonic()))
                if slot.process.is_alive():
                    log.warning("inference process %s did not stop; killing", slot.process.pid)
                    slot.process.kill()
                    slot.process.join(timeout=2.0)

    def _spawn(self, slot: Slot) -> None:
        process = self._ctx.Process(target=serve, args=(slot.model, slot.device, slot.index),
                                    name=f"conveyor-{slot.model}-{slot.index}", daemon=False)
        process.start()
        slot.process = process
        slot.started = time.monotonic()
        if process.pid is not None:
            slot.pids.append(process.pid)
        log.info("started inference process %s for %s on %s", process.pid, slot.model,
                 slot.device)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            for slot in self.slots:
                process = slot.process
                if process is not None and not process.is_alive():
                    self._on_exit(slot, process, now)
                if slot.process is None and now >= slot.next_start and not self._stop.is_set():
                    self._spawn(slot)

    def _on_exit(self, slot: Slot, process: BaseProcess, now: float) -> None:
        lived = now - slot.started
        if lived >= HEALTHY_AFTER_S:
            slot.backoff_s = BACKOFF_START_S
        log.error("inference process %s for %s exited (code %s) after %.1fs; restarting in "
                  "%.1fs", process.pid, slot.model, process.exitcode, lived, slot.backoff_s)
        self._forget(slot, process)
        slot.process = None
        slot.restarts += 1
        slot.next_start = now + slot.backoff_s
        slot.backoff_s = min(slot.backoff_s * 2, BACKOFF_MAX_S)

    def _forget(self, slot: Slot, process: BaseProcess) -> None:
        """Remove the dead process's heartbeat so readiness stops counting it at once."""
        try:
            beats = self._redis.hgetall(self.keys.workers(slot.model))
            dead = [c for c in beats if c.decode().split(":")[1] == str(process.pid)]
            if dead:
                self._redis.hdel(self.keys.workers(slot.model), *dead)
        except (redis.RedisError, OSError) as exc:
            log.warning("could not clear heartbeat of %s: %s", process.pid, exc)
