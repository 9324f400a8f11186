"""Model repository control: the index, hot load and unload, shared through one Redis hash.

``Keys.repository()`` maps a model name to ``{"state": "loaded"|"unloaded", "ts": epoch_s}``.
A model without a field is loaded when its folder is in the repository at start-up. A
load re-reads the model's folder, adds it to this process's registry and marks it loaded;
an unload marks it unloaded and drops it from the registry, so new requests for it get
404 while requests already in flight keep waiting for their replies (the workers drain
them before they stop the model's processes). Every API process polls the hash, so the
others follow within one interval; the workers follow the same hash. Load and unload
over HTTP and gRPC need ``model_control = "explicit"``; the hash itself is followed in
either mode (``conveyor models`` writes it too).

A model whose configuration fails stays in ``failed`` with the reason, and the index
shows it UNAVAILABLE; every other model serves.

A load that changes the configuration of a model whose workers serve it is a reload: the
registry keeps the configuration that serves until processes running the new one are
ready (the workers start them beside the serving ones). If a worker reports that they
failed, the model stays as it was: the loading process records the previous
configuration again and answers the failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from api.dispatch_port import DispatchPort
from api.ensemble import Ensembles
from api.health import WorkerWatch
from api.periodic import Periodic
from batching.config import ConfigError, ModelConfig
from batching.errors import InvalidInput, ModelControlDisabled, ModelNotFound, Unavailable
from batching.keys import Keys
from batching.names import model_folder, require_folder, unknown_model, unknown_to_load
from batching.redis_errors import REDIS_FAILED
from batching.repository_scan import (
    as_text,
    config_digest,
    failure_reason,
    is_model_folder,
    load_model_config,
    model_folders,
    parse_record,
    record_value,
    served_versions,
    stale_entries,
    state_rows,
    status_table,
    version_folders,
)
from batching.triton_repository import json_config

log = logging.getLogger(__name__)

LOAD_READY_TIMEOUT_S = 120.0
"""How long a load waits for a worker to report the model ready before answering 503."""
READY_POLL_S = 0.1
CONTROL_DISABLED = ("explicit model load / unload is not allowed: model control mode is "
                    "'none' (set CONVEYOR_MODEL_CONTROL=explicit)")


class Repository:
    def __init__(self, root: Path, only: set[str] | None, models: dict[str, ModelConfig],
                 unloaded: set[str], dispatcher: DispatchPort, watch: WorkerWatch, keys: Keys,
                 interval_s: float, failed: dict[str, str] | None = None,
                 control: bool = False, ensembles: Ensembles | None = None) -> None:
        """``failed`` (model -> reason) is shared with the service and the worker watch;
        ``control`` allows load and unload over the API; ``ensembles``, the service's."""
        self.root = root
        self._only = only
        self._models = models
        self._unloaded = unloaded
        self._failed = failed if failed is not None else {}
        self._dispatcher = dispatcher
        self._watch = watch
        self._keys = keys
        self._control = control
        self._ensembles = ensembles or Ensembles()
        self._seen: dict[str, bytes] = {}
        """The hash value last applied per model: only changes are acted on."""
        self._pending: dict[str, tuple[ModelConfig, dict[str, Any] | None, float]] = {}
        """A reload the workers stage, per model: its configuration, the load's and when it
        was recorded."""
        self._serving: dict[str, dict[str, Any] | None] = {}
        """The configuration a load gave per model, that the registry serves."""
        self._loop = Periodic("conveyor-repository-watch", interval_s, self.sync)

    async def start(self) -> None:
        await self.drop_stale()
        await self.sync()
        rows = state_rows(self._models, self._failed, self._unloaded)
        level = logging.WARNING if self._failed else logging.INFO  # seen by default then
        log.log(level, "model repository %s:\n%s", self.root,
                status_table(rows, served_versions(self._models)))
        self._loop.start()

    async def close(self) -> None:
        await self._loop.close()

    async def drop_stale(self) -> None:
        """Forget recorded loads and unloads of models whose folder is gone."""
        try:
            redis = self._dispatcher.redis
            names = [as_text(n) for n in await redis.hkeys(self._keys.repository())]
            stale = stale_entries(self.root, names)
            if stale:
                await redis.hdel(self._keys.repository(), *stale)
                log.warning("dropped the recorded state of models no longer in the "
                            "repository: %s", stale)
        except REDIS_FAILED as exc:
            log.warning("could not check the recorded repository state: %s", exc)

    async def sync(self) -> None:
        """Apply loads and unloads that any API process recorded in the hash."""
        try:
            states = await self._dispatcher.redis.hgetall(self._keys.repository())
        except REDIS_FAILED as exc:
            log.debug("repository refresh failed: %s", exc)
            return
        for raw_name, raw_value in states.items():
            name, value = as_text(raw_name), _bytes(raw_value)
            if self._seen.get(name) == value or not self._serves(name):
                continue
            record = parse_record(value)
            if record.ts < parse_record(self._seen.get(name)).ts:
                continue  # read before a change this process made meanwhile: stale
            self._seen[name] = value
            folder = model_folder(self.root, name)
            if folder is None:
                continue  # not a model of this repository: nothing to apply
            if record.state == "unloaded":
                self._drop(name)
            elif record.state == "loaded":
                try:
                    config = await asyncio.to_thread(load_model_config, folder, record.config)
                except Exception as exc:  # one model's config never stops the others
                    self._failed[name] = failure_reason(folder, exc)
                    log.error("cannot load %s: %s", name, self._failed[name])
                    continue
                if not self._stage(name, config, record.config, record.ts):
                    self._add(name, config, record.config)
        self._settle()

    def _stage(self, name: str, config: ModelConfig, override: dict[str, Any] | None,
               at: float) -> bool:
        """Hold ``config`` (``override``'s) back while the model's workers serve another:
        whether it is a reload (the registry switches once they are ready, in
        :meth:`_settle`)."""
        if (name not in self._models or not self._watch.model_ready(name)
                or self._watch.ready_with(name, config_digest(override))):
            return False
        self._pending[name] = (config, override, at)
        return True

    def _settle(self) -> None:
        """Switch to the configuration of a reload once its processes are ready; keep the
        one that serves if they failed."""
        for name, (config, override, at) in list(self._pending.items()):
            digest = config_digest(override)
            if self._watch.ready_with(name, digest):
                self._add(name, config, override)
            elif (reason := self._reload_failure(name, digest, at)) is not None:
                del self._pending[name]
                log.error("reloading %s failed, its loaded version serves: %s", name, reason)

    def _reload_failure(self, name: str, digest: str, since: float) -> str | None:
        """Why a worker failed to load the model with the configuration of ``digest`` after
        ``since`` (epoch seconds), if one reported it."""
        workers = self._watch.view.get(name)
        for beat in workers.states if workers is not None else []:
            if (beat.get("state") == "failed" and beat.get("config", "") == digest
                    and float(beat.get("since", 0)) > since):
                return str(beat.get("reason") or "it failed to load")
        return None

    def _serves(self, name: str) -> bool:
        return not self._only or name in self._only

    def _add(self, name: str, config: ModelConfig,
             override: dict[str, Any] | None = None) -> None:
        self._pending.pop(name, None)
        self._serving[name] = override
        self._models[name] = config
        self._unloaded.discard(name)
        self._failed.pop(name, None)
        log.info("model %s loaded", name)

    def _drop(self, name: str) -> None:
        self._pending.pop(name, None)
        self._serving.pop(name, None)
        self._models.pop(name, None)
        self._failed.pop(name, None)
        self._unloaded.add(name)
        log.info("model %s unloaded", name)

    async def _record(self, name: str, state: str,
                      config: dict[str, Any] | None = None) -> float:
        at = time.time()
        value = record_value(state, at, config)
        try:
            await self._dispatcher.redis.hset(self._keys.repository(), name, value)
        except REDIS_FAILED as exc:
            raise Unavailable(f"Redis is unreachable: {exc}") from None
        self._seen[name] = value
        return at

    def _folder(self, name: str) -> Path:
        """The model's folder, after the control and name checks every request passes."""
        if not self._control:
            raise ModelControlDisabled(CONTROL_DISABLED)
        folder = require_folder(self.root, name)
        if not self._serves(name):
            raise unknown_model(name)
        return folder

    async def load(self, name: str, config_json: str | None = None) -> None:
        """Read the model's folder again (with ``config_json``, a ModelConfig in Triton's
        JSON form, in place of its configuration file), mark it loaded, and wait until a
        worker serves it, or reports that it failed to load. A failed reload leaves the
        model as it was, its previous configuration recorded again."""
        try:
            folder = self._folder(name)
        except ModelNotFound:
            raise unknown_to_load(name) from None
        if not is_model_folder(folder):
            raise unknown_to_load(name)
        try:
            override = None if config_json is None else json_config(name, config_json)
            config = await asyncio.to_thread(load_model_config, folder, override)
        except ConfigError as exc:  # the client's config: reported to it, the model unchanged
            if config_json is None:
                self._failed[name] = failure_reason(folder, exc)
            raise InvalidInput(f"failed to load model {name!r}: "
                               f"{failure_reason(folder, exc)}") from None
        except Exception as exc:  # the folder's fault, reported to the caller
            self._failed[name] = failure_reason(folder, exc)
            raise InvalidInput(f"failed to load model {name!r}: {self._failed[name]}") from None
        previous = self._serving.get(name)
        digest = config_digest(override)
        recorded = await self._record(name, "loaded", override)
        reload = self._stage(name, config, override, recorded)
        if not reload:
            self._add(name, config, override)
        deadline = time.monotonic() + LOAD_READY_TIMEOUT_S
        while not self._watch.ready_with(name, digest):
            failure = self._load_failure(name, digest, recorded, reload)
            if failure is not None:
                if reload:
                    self._pending.pop(name, None)
                    await self._record(name, "loaded", previous)
                raise InvalidInput(f"failed to load model {name!r}: {failure}")
            if time.monotonic() > deadline:
                raise Unavailable(f"model {name!r} is loaded but no worker reported it ready "
                                  f"within {LOAD_READY_TIMEOUT_S:.0f} s")
            await asyncio.sleep(READY_POLL_S)
            await self._watch.refresh()
        self._add(name, config, override)

    def _load_failure(self, name: str, digest: str, since: float, reload: bool) -> str | None:
        """Why the load recorded at ``since`` failed, once a worker reported it: for a
        reload, its new processes; otherwise any, while none is ready."""
        if reload:
            return self._reload_failure(name, digest, since)
        failure = self._watch.failure(name)
        return failure[1] if failure is not None and failure[0] > since else None

    async def unload(self, name: str) -> None:
        """Stop accepting requests for ``name``; in-flight ones finish."""
        self._folder(name)
        if name not in self._models and name not in self._failed:
            if name in self._unloaded:
                return
            raise unknown_model(name)
        await self._record(name, "unloaded")
        self._drop(name)

    async def index(self, ready_only: bool = False, reasons: bool = True) -> list[dict[str, Any]]:
        """Every model folder with Triton's state (READY, LOADING, UNAVAILABLE) and reason.

        ``reasons=False`` (the metrics scrape) skips re-reading the config of folders that
        are neither loaded nor unloaded: their state is UNAVAILABLE whatever the reason."""
        entries = []
        for folder in await asyncio.to_thread(model_folders, self.root):
            name = folder.name
            if not self._serves(name):
                continue
            state, reason = await self._state(name, folder, reasons)
            if ready_only and state != "READY":
                continue
            config = self._models.get(name)
            versions = (config.served_versions if config is not None
                        else [str(v) for v in version_folders(folder)] or ["1"])
            for version in versions:
                entry = {"name": name, "version": version, "state": state}
                if reason:
                    entry["reason"] = reason
                entries.append(entry)
        return entries

    async def _state(self, name: str, folder: Path, reasons: bool) -> tuple[str, str]:
        if name in self._ensembles.plans:
            if self._ensembles.ready(name, self._watch.model_ready):
                return "READY", ""
            return "UNAVAILABLE", "a step model has no ready worker"
        if name in self._models:
            if self._watch.model_ready(name):
                return "READY", ""
            failure = self._watch.failure(name)
            if failure is not None:
                return "UNAVAILABLE", failure[1]
            if self._watch.model_served(name):
                return "LOADING", "its worker processes are loading it"
            return "UNAVAILABLE", "no worker serves it"
        if name in self._unloaded:
            return "UNAVAILABLE", "unloaded"
        if not reasons:
            return "UNAVAILABLE", ""
        try:
            await asyncio.to_thread(load_model_config, folder)
        except Exception as exc:  # reported in the index, never raised from it
            return "UNAVAILABLE", failure_reason(folder, exc)
        return "UNAVAILABLE", "not loaded"


def _bytes(raw: bytes | str) -> bytes:
    return raw if isinstance(raw, bytes) else raw.encode()
