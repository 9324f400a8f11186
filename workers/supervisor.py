"""Supervises one inference process per model instance, from inside the Celery worker.

Processes start with ``spawn``. The supervisor replaces a process that dies, and kills
(SIGTERM, then SIGKILL after a grace) one whose batch outlives ``execution_timeout_s``
or whose heartbeat stopped. Replacements back off exponentially; a model that never
gets to ready ``MAX_LOAD_FAILURES`` times in a row, or whose loading raised (an
exception in ``model.py``'s import or ``__init__``, a bad artifact), is marked ``failed``
and retried slowly; its heartbeat then carries the reason. The Celery main process never
exits because a model failed, so a broken model cannot crash-loop the pod. Repository
load/unload requests (a Redis hash) start and stop a model's processes; a name there that
is not a model folder of this worker's repository is ignored.

A load that changes a served model's configuration is staged beside the processes that
serve it, which stop only once every new one is ready; if one fails to load, the reload is
abandoned and the model keeps its processes and configuration.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import multiprocessing
import threading
import time
from collections.abc import Mapping
from multiprocessing.process import BaseProcess
from typing import Any

from batching.config import ModelConfig
from batching.keys import Keys
from batching.names import model_folder
from batching.redis_errors import REDIS_FAILED
from batching.redis_topology import sync_redis
from batching.repository_scan import (
    as_text,
    config_digest,
    failure_reason,
    load_model_config,
    parse_record,
    scan_repository,
    served_versions,
    stale_entries,
    state_rows,
    status_table,
)
from batching.resp import RespError
from batching.settings import Settings
from batching.tensor_arena import host_token
from workers.process import serve
from workers.shared_state import ProcState, SharedState
from workers.slot import Slot, retry_failed
from workers.unload import turn_away

log = logging.getLogger("conveyor.supervisor")

HEALTHY_AFTER_S = 30.0
"""A process that has lived this long resets its slot's back-off."""
MAX_LOAD_FAILURES = 5
FAILED_RETRY_S = 60.0
KILL_GRACE_S = 2.0
STARTUP_SILENCE_S = 60.0
"""How long a process that has not loaded yet may go without a heartbeat."""
STOP_GRACE_S = 20.0
REASON_BYTES = 512
"""Room for the one line an inference process reports when loading its model raised."""
TICK_S = 0.2


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self._shm = host_token()
        """This host's shared-memory token, which its processes will carry too
        (batching/tensor_arena.py): a slot announced before its process beats does not
        turn an API's tensor arena off for the model."""
        scan = scan_repository(settings.model_repository, settings.model_filter() or None)
        table = status_table(state_rows(scan.models, scan.failed), served_versions(scan.models))
        log.log(logging.WARNING if scan.failed else logging.INFO, "model repository %s:\n%s",
                settings.model_repository, table)
        self.models: dict[str, ModelConfig] = scan.models
        self.slots: list[Slot] = []
        self._applied: dict[str, bytes | str] = {}
        """The repository hash value last acted on per model."""
        self._refused: dict[str, str] = {}
        """Why a recorded name was not loaded (logged once per reason)."""
        self._overrides: dict[str, dict[str, Any] | None] = {}
        """The configuration a repository load gave per model, which its processes run."""
        self._staged: dict[str, ModelConfig] = {}
        """The configuration of a reload being staged, per model."""
        self._generations = itertools.count(1)
        self._ctx = multiprocessing.get_context("spawn")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="conveyor-supervisor",
                                        daemon=True)
        self._redis = sync_redis(settings.redis_url, socket_connect_timeout=1.0,
                                           socket_timeout=2.0)
        self._next_beat = 0.0

    def start(self) -> None:
        self._drop_stale()
        for config in self.models.values():
            self._add_slots(config)
        log.info("supervising %d inference processes for %s", len(self.slots),
                 sorted(self.models))
        self._thread.start()

    def ready(self) -> bool:
        """Every active slot is ready or has failed (a failed model is settled, as the
        API's readiness counts it); a reload being staged does not count."""
        active = [s for s in self.slots if not s.retired and not s.staged]
        return bool(active) and all(s.ready or s.failed for s in active)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """SIGTERM every process (each finishes its batch and acks), then wait, then kill."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        _stop_processes([s.process for s in self.slots if s.process is not None])
        with contextlib.suppress(*REDIS_FAILED):
            for slot in self.slots:
                self._redis.hdel(self.keys.workers(slot.model), slot.name)

    def _drop_stale(self) -> None:
        """Forget recorded loads and unloads of models whose folder is gone."""
        try:
            names = [as_text(n) for n in self._redis.hkeys(self.keys.repository())]
            stale = stale_entries(self.settings.model_repository, names)
            if stale:
                self._redis.hdel(self.keys.repository(), *stale)
                log.warning("dropped the recorded state of models no longer in the "
                            "repository: %s", stale)
        except REDIS_FAILED as exc:
            log.warning("could not check the recorded repository state: %s", exc)

    def _add_slots(self, config: ModelConfig, override: dict[str, Any] | None = None,
                   generation: int = 0) -> None:
        """The model's slots; none when it has slots already (a load is idempotent), unless
        they are a reload's (``generation`` above 0), staged beside them."""
        if not generation and any(s.model == config.name and not s.retired
                                  for s in self.slots):
            return
        for group in config.instances:
            for i in range(group.count):
                self.slots.append(Slot(config.name, group.device, i, config.execution_timeout_s,
                                       override, staged=bool(generation),
                                       generation=generation))

    def _spawn(self, slot: Slot) -> None:
        slot.shared = SharedState(self._ctx)
        slot.failure = self._ctx.Array("c", REASON_BYTES)
        process = self._ctx.Process(target=serve,
                                    args=(slot.model, slot.device, slot.index, slot.shared,
                                          slot.failure, slot.override),
                                    name=f"conveyor-{slot.model}-{slot.index}", daemon=False)
        process.start()
        slot.process, slot.started, slot.kill_at = process, time.monotonic(), 0.0
        log.info("started inference process %s for %s on %s", process.pid, slot.model,
                 slot.device)

    def _watch(self) -> None:
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            for slot in self.slots:
                self._check(slot, now)
            for model in {s.model for s in self.slots if s.staged and not s.retired}:
                self._settle(model)
            if now >= self._next_beat:
                self._next_beat = now + self.settings.heartbeat_interval_s
                self._sync_with_redis()

    def _check(self, slot: Slot, now: float) -> None:
        process = slot.process
        if process is not None and not process.is_alive():
            self._on_exit(slot, process, now)
        elif process is not None and slot.shared is not None:
            if slot.shared.state == ProcState.READY:
                slot.load_failures, slot.failed, slot.reason = 0, False, ""
            reason = self._hung(slot, now)
            if reason and not slot.kill_at:
                log.error("killing inference process %s for %s: %s", process.pid, slot.model,
                          reason)
                process.terminate()
                slot.kill_at = now + KILL_GRACE_S
            elif slot.kill_at and now >= slot.kill_at:
                process.kill()
        if slot.process is None and not slot.retired and now >= slot.next_start:
            self._spawn(slot)

    def _hung(self, slot: Slot, now: float) -> str:
        assert slot.shared is not None
        busy = slot.shared.busy_since
        if busy and now - busy > slot.execution_timeout_s:
            return f"batch running for {now - busy:.1f}s > execution_timeout_s"
        # A starting process beats only once its interpreter and imports are up.
        limit = (self.settings.heartbeat_stale_s if slot.shared.state != ProcState.LOADING
                 else STARTUP_SILENCE_S)
        if now - slot.shared.last_beat > limit:
            return f"no heartbeat for {now - slot.shared.last_beat:.1f}s"
        return ""

    def _on_exit(self, slot: Slot, process: BaseProcess, now: float) -> None:
        lived = now - slot.started
        was_ready = slot.shared is not None and slot.shared.state != ProcState.LOADING
        slot.process = None
        if slot.retired:
            self._forget(slot, process)
            return
        if lived >= HEALTHY_AFTER_S:
            slot.backoff.reset()
        slot.load_failures = 0 if was_ready else slot.load_failures + 1
        raised = slot.failure.value.decode(errors="replace") if slot.failure is not None else ""
        if raised or slot.load_failures >= MAX_LOAD_FAILURES:
            slot.failed, slot.failed_at = True, time.time()
            slot.reason = raised or (f"{slot.model}: its process exited (code "
                                     f"{process.exitcode}) before it was ready, "
                                     f"{slot.load_failures} times in a row")
        delay = slot.backoff.next()
        if slot.failed:
            delay = FAILED_RETRY_S
        log.error("inference process %s for %s exited (code %s) after %.1fs; %s, restarting "
                  "in %.1fs", process.pid, slot.model, process.exitcode, lived,
                  f"model marked failed: {slot.reason}" if slot.failed else "replacing it",
                  delay)
        slot.restarts += 1
        slot.next_start = now + delay
        with contextlib.suppress(*REDIS_FAILED):
            self._redis.hincrby(self.keys.stats(slot.model), "restart_count", 1)
            # Announce the replacement before the dead heartbeat goes: the model is never
            # without a heartbeat while it is being restarted.
            self._redis.hset(self.keys.workers(slot.model), slot.name, self._slot_beat(slot))
        self._forget(slot, process)

    def _slot_beat(self, slot: Slot) -> str:
        state = "failed" if slot.failed else "restarting" if slot.restarts else "loading"
        beat = {"state": state, "model": slot.model, "device": slot.device,
                "restarts": slot.restarts, "ts": time.time(),
                "config": config_digest(slot.override)}
        if self._shm is not None:  # its process, of this host and user, will read the arenas
            beat["shm"] = self._shm
        if slot.failed:
            beat.update(reason=slot.reason, since=slot.failed_at)
        return json.dumps(beat)

    def _forget(self, slot: Slot, process: BaseProcess) -> None:
        """Remove the dead process's heartbeat so its entries are claimed at once."""
        try:
            beats = self._redis.hgetall(self.keys.workers(slot.model))
            dead = [c for c in beats if as_text(c).split(":")[1] == str(process.pid)]
            if dead:
                self._redis.hdel(self.keys.workers(slot.model), *dead)
        except REDIS_FAILED as exc:
            log.warning("could not clear heartbeat of %s: %s", process.pid, exc)

    def _sync_with_redis(self) -> None:
        """Apply repository load/unload, then announce slots that have no ready process
        (in this order: a failed slot that a new load retries never beats failed again)."""
        try:
            self._apply_repository(self._redis.hgetall(self.keys.repository()))
            pipe = self._redis.pipeline(transaction=False)
            for slot in self.slots:
                key = self.keys.workers(slot.model)
                if slot.ready or slot.retired:
                    pipe.hdel(key, slot.name)
                else:
                    pipe.hset(key, slot.name, self._slot_beat(slot))
            pipe.execute()
        except REDIS_FAILED as exc:
            log.debug("Redis unreachable from the supervisor: %s", exc)
            return
        # Their heartbeats are gone now: forget retired slots whose process has exited.
        self.slots = [s for s in self.slots if not (s.retired and s.process is None)]

    def _apply_repository(self, states: Mapping[bytes | str, bytes | str]) -> None:
        for raw_name, raw in states.items():
            model = as_text(raw_name)
            if model_folder(self.settings.model_repository, model) is None:
                self._refuse(model, "not a model folder of this repository")
                continue
            changed = self._applied.get(model) != raw
            self._applied[model] = raw
            record = parse_record(raw)
            state = record.state
            slots = [s for s in self.slots if s.model == model]
            if state == "unloaded" and any(not s.retired for s in slots):
                log.info("unloading %s", model)
                self._staged.pop(model, None)
                for slot in slots:
                    slot.retired = True
                threading.Thread(target=self._unload, daemon=True,
                                 args=(model, [s.process for s in slots if s.process])).start()
            elif state == "loaded" and (not slots or all(s.retired for s in slots)):
                self._load(model, slots, record.config)
            elif state == "loaded" and changed:
                self._reload(model, slots, record.config)

    def _refuse(self, model: str, reason: str) -> None:
        """Log, once per reason, why a recorded model is not served."""
        if self._refused.get(model) != reason:
            self._refused[model] = reason
            log.error("not loading %r: %s", model[:200], reason)

    def _unload(self, model: str, processes: list[BaseProcess]) -> None:
        """Stop the model's processes, then answer what they left unread."""
        _stop_processes(processes)
        config = self.models.get(model)
        try:
            turn_away(self._redis, self.settings.redis_url, self.keys, model,
                      config.queue.priority_levels if config else 1,
                      config.queue.partitions if config else 1)
        except (*REDIS_FAILED, RespError) as exc:
            log.warning("could not answer the unread requests of %s: %s", model, exc)

    def _reload(self, model: str, slots: list[Slot], override: dict[str, Any] | None) -> None:
        """A new load of a served model: a reload still staged is dropped; a load of the
        configuration its processes run retries its failed slots, one of another starts
        slots running it beside them (see :meth:`_settle`)."""
        _retire([s for s in slots if s.staged and not s.retired])
        self._staged.pop(model, None)
        if override == self._overrides.get(model):
            retry_failed([s for s in slots if not s.staged])
            return
        folder = self.settings.model_repository / model
        try:
            config = load_model_config(folder, override)
        except Exception as exc:  # the serving processes stay
            self._refuse(model, failure_reason(folder, exc))
            return
        self._refused.pop(model, None)
        log.info("reloading %s with a new configuration beside its serving processes", model)
        self._staged[model] = config
        self._add_slots(config, override, next(self._generations))

    def _settle(self, model: str) -> None:
        """A staged reload whose slots are all ready replaces the slots that serve (they
        stop, finishing what they hold; their unread requests go to the new ones); one
        whose slot failed is abandoned: the others stop, the failed one stays to publish
        why (never restarted: the next load decides)."""
        staged = [s for s in self.slots if s.model == model and s.staged and not s.retired]
        if any(s.failed for s in staged):
            if model in self._staged:
                del self._staged[model]
                log.error("reloading %s failed; its serving processes stay: %s", model,
                          next(s.reason for s in staged if s.failed))
            for slot in staged:
                slot.next_start = math.inf
            _retire([s for s in staged if not s.failed])
        elif all(s.ready for s in staged) and model in self._staged:
            _retire([s for s in self.slots if s.model == model and not s.staged])
            for slot in staged:
                slot.staged = False
            self.models[model] = self._staged.pop(model)
            self._overrides[model] = staged[0].override
            log.info("reloaded %s: its new processes serve", model)

    def _load(self, model: str, old: list[Slot], override: dict[str, Any] | None) -> None:
        if self.settings.model_filter() and model not in self.settings.model_filter():
            return
        folder = self.settings.model_repository / model
        try:
            config = load_model_config(folder, override)
        except Exception as exc:  # one model's config never stops the others
            self._refuse(model, failure_reason(folder, exc))
            return
        self._refused.pop(model, None)
        if any(s.process is not None for s in old):
            return  # still draining from the unload; load on a later tick
        self.slots = [s for s in self.slots if s.model != model]
        self.models[model] = config
        self._overrides[model] = override
        self._add_slots(config, override)
        log.info("loaded %s", model)


def _retire(slots: list[Slot]) -> None:
    """Retire the slots and stop their processes, in the background."""
    if not slots:
        return
    for slot in slots:
        slot.retired = True
    threading.Thread(target=_stop_processes, daemon=True,
                     args=([s.process for s in slots if s.process],)).start()


def _stop_processes(processes: list[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            log.warning("inference process %s did not stop; killing", process.pid)
            process.kill()
            process.join(timeout=2.0)
