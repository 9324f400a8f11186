"""Entry point of a spawned inference process: load the model once, then run the loop."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from batching.keys import Keys
from batching.lifetime import die_with_parent
from batching.redis_errors import REDIS_UNREACHABLE
from batching.redis_links import blocking_link
from batching.redis_topology import sync_redis
from batching.repository_scan import (
    artifact_folder,
    config_digest,
    failure_reason,
    load_model_config,
)
from batching.settings import Settings
from batching.tensor_arena import host_token
from workers.batch_run import DeviceLost
from workers.cpu_threads import lone_threads, with_cpu_threads
from workers.events import make_batch_events
from workers.every_core import load_served
from workers.heartbeat import Heartbeat
from workers.inference import BLOCK_MS, FATAL_EXIT_CODE, InferenceLoop
from workers.recovery import Reclaimer
from workers.shared_state import ProcState, SharedState
from workers.streams import ModelStreams

log = logging.getLogger("conveyor.inference")



def consumer_name(model: str, device: str, index: int) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{model}:{device}:{index}"


def serve(model_name: str, device: str, index: int, shared: SharedState,
          failure: Any, override: dict[str, Any] | None = None) -> None:
    """``failure`` (a shared ``c`` array) receives, if loading the model raises, the one
    line its supervisor publishes as the reason the model failed. ``override`` is the
    configuration a repository load gave in place of the folder's."""
    die_with_parent(signal.SIGTERM)  # the supervisor gone (worker killed): stop as it would
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    settings = Settings()
    folder = Path(settings.model_repository) / model_name
    try:
        _serve(model_name, device, index, shared, settings, folder, override)
    except Exception as exc:
        if shared.state == ProcState.LOADING:
            failure.value = failure_reason(folder, exc).encode()[:len(failure) - 1]
        raise


def pipelined(device: str) -> bool:
    """Whether the model runs on its own thread (docs/data-path.md, "The pipelined inference
    process"): on an accelerator, whose work leaves the CPU free for reading and answering.
    A CPU model competes for the same cores as the loop, the API and Redis: measured on two
    cores, the overlap cost mlp_tiny a quarter of its throughput and gained mlp_medium
    nothing."""
    return device != "cpu"


def _serve(model_name: str, device: str, index: int, shared: SharedState, settings: Settings,
           folder: Path, override: dict[str, Any] | None) -> None:
    keys = Keys(settings.key_prefix)
    config = load_model_config(folder, override)
    consumer = consumer_name(model_name, device, index)
    client = sync_redis(settings.redis_url, socket_connect_timeout=1.0,
                                  socket_timeout=BLOCK_MS / 1000 + 5, health_check_interval=30)
    heartbeat = Heartbeat(client, keys, model_name, consumer, device,
                          settings.heartbeat_interval_s, on_beat=shared.beat)
    shm = host_token()
    if shm is not None:  # API processes that see the same token pass large inputs in memory
        heartbeat.info["shm"] = shm
    heartbeat.start()
    link = blocking_link(settings.redis_url, BLOCK_MS / 1000 + 5, settings.lean_redis)
    first, *more = keys.partitions(model_name, config.queue.priority_levels,
                                   config.queue.partitions)
    streams = ModelStreams(client, link, list(first.streams), keys.stats(model_name), first.rows,
                           consumer, settings.busy_poll_us / 1e6,
                           suspects_key=keys.suspects(model_name), withdrawn_key=first.withdrawn,
                           more=tuple(more))
    reclaimer = Reclaimer(client, keys, model_name, streams, settings.heartbeat_stale_s)
    lone = (lone_threads(config, settings.reserved_cores, device)
            if settings.lone_all_cores else None)
    config = with_cpu_threads(config, settings.reserved_cores)
    versions = {v: load_served(config, artifact_folder(folder, config, v), device, lone)
                for v in config.served_versions}
    loop = InferenceLoop(config, versions[config.served_versions[-1]], streams, reclaimer,
                         shared, keys, pipelined=pipelined(device), versions=versions)
    loop.events = make_batch_events(model_name, settings)

    def stop(_signum: int, _frame: object) -> None:
        loop.stopping = True
        shared.state = ProcState.STOPPING

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    _retry(streams.ensure_groups)
    shared.row_cap = loop.row_cap.cap
    shared.state = ProcState.READY
    heartbeat.update(state="ready", config=config_digest(override),
                     max_batch_size=config.max_batch_size,
                     row_cap=loop.row_cap.cap)
    log.info("%s ready on %s as %s", model_name, device, consumer)
    gc.collect()
    gc.freeze()
    backoff = 0.1
    next_report = 0.0
    while not (loop.stopping and loop.idle):
        try:
            loop.step()
            backoff = 0.1
        except REDIS_UNREACHABLE as exc:
            log.warning("Redis unreachable (%s); retrying in %.1fs", exc, backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
        except DeviceLost as exc:
            log.critical("device context lost (%s); exiting so a new process takes over", exc)
            sys.exit(FATAL_EXIT_CODE)
        if time.monotonic() >= next_report:
            next_report = time.monotonic() + settings.heartbeat_interval_s
            _report_and_follow(loop, heartbeat, client, keys.control(model_name))
    with contextlib.suppress(*REDIS_UNREACHABLE):
        streams.flush_counts(force=True)
    heartbeat.stop()
    log.info("%s stopped after %d batches, %d rows", consumer, loop.batches, loop.rows)


def _report_and_follow(loop: InferenceLoop, heartbeat: Heartbeat, client: redis.Redis,
                       control_key: str) -> None:
    """Publish the loop's figures with the next heartbeat; apply run-time overrides."""
    heartbeat.info.update(loop.stats(), policy=loop.policy.estimates())
    with contextlib.suppress(*REDIS_UNREACHABLE):
        loop.streams.flush_counts(force=True)
    memory = gpu_memory(heartbeat.info["device"])
    if memory:
        heartbeat.info["gpu_memory"] = memory
    try:
        overrides = client.hgetall(control_key)
    except REDIS_UNREACHABLE:
        return
    if overrides:
        loop.apply_control({k.decode() if isinstance(k, bytes) else k: int(v)
                            for k, v in overrides.items()})


def gpu_memory(device: str) -> dict[str, int] | None:
    """Used and total bytes of a CUDA device, when torch drives it."""
    torch = sys.modules.get("torch")
    if torch is None or not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"used": int(total - free), "total": int(total)}


def _retry(action: Callable[[], None]) -> None:
    delay = 0.1
    while True:
        try:
            action()
            return
        except REDIS_UNREACHABLE as exc:
            log.warning("Redis unreachable (%s); retrying", exc)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
