"""Model repository control: the index, hot load and unload, shared through one Redis hash.

``Keys.repository()`` maps a model name to ``{"state": "loaded"|"unloaded", "ts": epoch_s}``.
A model without a field is loaded when its folder is in the repository at start-up. A
load re-reads the model's folder, adds it to this process's registry and marks it loaded;
an unload marks it unloaded and drops it from the registry, so new requests for it get
404 while requests already in flight keep waiting for their replies (the workers drain
them before they stop the model's processes). Every API process polls the hash, so the
others follow within one interval; the workers follow the same hash.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import orjson
from redis.exceptions import RedisError

from api.dispatch import Dispatcher
from api.health import WorkerWatch
from batching.config import ConfigError, ModelConfig
from batching.errors import InvalidInput, ModelNotFound, Unavailable
from batching.keys import Keys
from batching.repository import artifact_backend, load_model_config

log = logging.getLogger(__name__)

LOAD_READY_TIMEOUT_S = 120.0
"""How long a load waits for a worker to report the model ready before answering 503."""
READY_POLL_S = 0.1


class Repository:
    def __init__(self, root: Path, only: set[str] | None, models: dict[str, ModelConfig],
                 unloaded: set[str], dispatcher: Dispatcher, watch: WorkerWatch, keys: Keys,
                 interval_s: float) -> None:
        self.root = root
        self._only = only
        self._models = models
        self._unloaded = unloaded
        self._dispatcher = dispatcher
        self._watch = watch
        self._keys = keys
        self._interval_s = interval_s
        self._seen: dict[str, bytes] = {}
        """The hash value last applied per model: only changes are acted on."""
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.sync()
        self._task = asyncio.create_task(self._run(), name="conveyor-repository-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.sync()

    async def sync(self) -> None:
        """Apply loads and unloads that any API process recorded in the hash."""
        try:
            states: dict[bytes, bytes] = await self._dispatcher.redis.hgetall(
                self._keys.repository())
        except (RedisError, OSError) as exc:
            log.debug("repository refresh failed: %s", exc)
            return
        for raw_name, value in states.items():
            name = raw_name.decode()
            if self._seen.get(name) == value or not self._serves(name):
                continue
            if _ts(value) < _ts(self._seen.get(name)):
                continue  # read before a change this process made meanwhile: stale
            self._seen[name] = value
            state = orjson.loads(value).get("state")
            if state == "unloaded":
                self._drop(name)
            elif state == "loaded":
                try:
                    self._add(name, await asyncio.to_thread(load_model_config, self.root / name))
                except (ConfigError, OSError, ValueError) as exc:
                    log.error("cannot load %s: %s", name, exc)

    def _serves(self, name: str) -> bool:
        return not self._only or name in self._only

    def _add(self, name: str, config: ModelConfig) -> None:
        self._models[name] = config
        self._unloaded.discard(name)
        log.info("model %s loaded", name)

    def _drop(self, name: str) -> None:
        self._models.pop(name, None)
        self._unloaded.add(name)
        log.info("model %s unloaded", name)

    async def _record(self, name: str, state: str) -> None:
        value = orjson.dumps({"state": state, "ts": time.time()})
        try:
            await self._dispatcher.redis.hset(self._keys.repository(), name, value)
        except (RedisError, OSError) as exc:
            raise Unavailable(f"Redis is unreachable: {exc}") from None
        self._seen[name] = value

    async def load(self, name: str) -> None:
        """Read the model's folder again, mark it loaded, and wait until a worker serves it."""
        folder = self.root / name
        if not self._serves(name) or not _is_model(folder):
            raise ModelNotFound(f"no model {name!r} in the repository")
        try:
            config = await asyncio.to_thread(load_model_config, folder)
        except (ConfigError, OSError, ValueError) as exc:
            raise InvalidInput(f"failed to load {name!r}: {exc}") from None
        await self._record(name, "loaded")
        self._add(name, config)
        deadline = time.monotonic() + LOAD_READY_TIMEOUT_S
        while not self._watch.model_ready(name):
            if time.monotonic() > deadline:
                raise Unavailable(f"model {name!r} is loaded but no worker reported it ready "
                                  f"within {LOAD_READY_TIMEOUT_S:.0f} s")
            await asyncio.sleep(READY_POLL_S)
            await self._watch.refresh()

    async def unload(self, name: str) -> None:
        """Stop accepting requests for ``name``; in-flight ones finish."""
        if name not in self._models:
            if name in self._unloaded:
                return
            raise ModelNotFound(f"unknown model {name!r}")
        await self._record(name, "unloaded")
        self._drop(name)

    async def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Every model folder with Triton's state (READY, LOADING, UNAVAILABLE) and reason."""
        entries = []
        folders = sorted(p for p in self.root.iterdir() if _is_model(p)) if self.root.is_dir() else []
        for folder in folders:
            name = folder.name
            if not self._serves(name):
                continue
            state, reason = await self._state(name, folder)
            if ready_only and state != "READY":
                continue
            entry = {"name": name, "version": "1", "state": state}
            if reason:
                entry["reason"] = reason
            entries.append(entry)
        return entries

    async def _state(self, name: str, folder: Path) -> tuple[str, str]:
        if name in self._models:
            if self._watch.model_ready(name):
                return "READY", ""
            if self._watch.model_served(name):
                return "LOADING", "its worker processes are loading it"
            return "UNAVAILABLE", "no worker serves it"
        if name in self._unloaded:
            return "UNAVAILABLE", "unloaded"
        try:
            await asyncio.to_thread(load_model_config, folder)
        except (ConfigError, OSError, ValueError) as exc:
            return "UNAVAILABLE", f"invalid configuration: {exc}"
        return "UNAVAILABLE", "not loaded"


def _is_model(folder: Path) -> bool:
    return (folder.is_dir() and not folder.name.startswith(".")
            and (artifact_backend(folder) is not None or (folder / "config.yaml").exists()))


def _ts(value: bytes | None) -> float:
    """When a repository hash value was recorded (0 for none)."""
    return float(orjson.loads(value).get("ts", 0)) if value else 0.0
