"""Celery remote-control commands of inference workers, and what they add to its stats.

- ``celery inspect stats`` (Flower's worker page, tab "Other"): :func:`worker_info` adds
  the models this worker serves and one line per inference process (model, device,
  index: state, pid, restarts).
- ``conveyor_stats``: per model this worker supervises, its inference processes' figures
  from their heartbeats (batches, rows, mean batch, learned row cap, state) and totals.
- ``conveyor_set_batching``: change ``max_queue_delay_us`` and/or ``max_batch_size`` of a
  model at run time. The values go to the model's control hash, which every inference
  process of the model (on any worker) applies with its next heartbeat, within about
  ``heartbeat_interval_s``; no restart. ``max_batch_size`` may lower the configured
  bound or restore it, never raise it.

::

    celery -A workers.app control conveyor_stats
    celery -A workers.app control conveyor_set_batching digits 0 16
    app.control.broadcast("conveyor_set_batching", reply=True,
                          arguments={"model": "digits", "max_batch_size": 16})
"""

from __future__ import annotations

import json
from typing import Any

import redis
from celery.worker.control import control_command

from batching.keys import Keys
from batching.redis_errors import REDIS_FAILED
from batching.redis_topology import sync_redis
from workers.supervisor import Supervisor

KNOBS = ("max_queue_delay_us", "max_batch_size")
FIGURES = ("batches", "rows", "mean_batch", "row_cap", "max_batch_size", "max_queue_delay_us")

_supervisor: Supervisor | None = None
_redis: redis.Redis | None = None


def attach(supervisor: Supervisor | None) -> None:
    """The bootstep tells us the supervisor it started (None when it stops)."""
    global _supervisor, _redis
    _supervisor = supervisor
    _redis = None if supervisor is None else sync_redis(
        supervisor.settings.redis_url, socket_connect_timeout=1.0, socket_timeout=2.0)


def worker_info() -> dict[str, str]:
    """``conveyor_models`` and one ``conveyor_slot <model>/<device>/<index>`` per inference
    process, `` staged`` after it for one a reload starts beside them (flat text, as
    Flower's worker page shows each value on one line)."""
    if _supervisor is None:
        return {}
    slots = [s for s in _supervisor.slots if not s.retired]
    info = {"conveyor_models": ", ".join(sorted({s.model for s in slots})) or "none"}
    for slot in slots:
        pid = slot.process.pid if slot.process is not None else None
        staged = " staged" if slot.staged else ""
        info[f"conveyor_slot {slot.model}/{slot.device}/{slot.index}{staged}"] = (
            f"{slot.state}, pid {pid}, {slot.restarts} restarts")
    return info


@control_command(args=[("model", str)], signature="[model]")
def conveyor_stats(state: Any, model: str | None = None) -> dict[str, Any]:
    """Per model: each inference process's heartbeat figures, and the model's totals."""
    if _supervisor is None or _redis is None:
        return {}
    keys = Keys(_supervisor.settings.key_prefix)
    models = sorted({s.model for s in _supervisor.slots if not s.retired and
                     (model is None or s.model == model)})
    try:
        pipe = _redis.pipeline(transaction=False)
        for name in models:
            pipe.hgetall(keys.workers(name))
        beats = pipe.execute()
    except REDIS_FAILED as exc:
        return {"error": f"Redis unreachable: {exc}"}
    return {name: _model_stats(name, raw) for name, raw in zip(models, beats, strict=True)}


def _model_stats(model: str, raw: dict[bytes, bytes]) -> dict[str, Any]:
    assert _supervisor is not None
    slots = [s for s in _supervisor.slots if s.model == model and not s.retired]
    pids = {str(s.process.pid) for s in slots if s.process is not None}
    names = {s.name for s in slots}
    instances = []
    for consumer, beat in raw.items():
        name = consumer.decode()
        if name in names or (name.count(":") >= 4 and name.split(":")[1] in pids):
            info = json.loads(beat)
            instances.append({"consumer": name, "state": info.get("state", "unknown"),
                              "device": info.get("device"), "pid": info.get("pid"),
                              **{k: info[k] for k in FIGURES if k in info}})
    ready = [i for i in instances if i["state"] == "ready"]
    batches = sum(int(i.get("batches", 0)) for i in instances)
    rows = sum(int(i.get("rows", 0)) for i in instances)
    states = {i["state"] for i in instances}
    return {
        "state": "ready" if states == {"ready"} else ",".join(sorted(states)) or "unknown",
        "instances": instances,
        "batches": batches,
        "rows": rows,
        "mean_batch": rows / batches if batches else 0.0,
        "row_cap": min((int(i["row_cap"]) for i in ready if "row_cap" in i), default=None),
    }


@control_command(
    args=[("model", str), ("max_queue_delay_us", int), ("max_batch_size", int)],
    signature="<model> [max_queue_delay_us] [max_batch_size]",
)
def conveyor_set_batching(state: Any, model: str, max_queue_delay_us: int | None = None,
                          max_batch_size: int | None = None) -> dict[str, Any]:
    """Set a model's run-time batching knobs (every instance applies them within a beat)."""
    if _supervisor is None or _redis is None:
        return {"error": "this worker runs no inference processes"}
    config = _supervisor.models.get(model)
    if config is None:
        return {"error": f"model {model!r} is not served by this worker"}
    wanted = {"max_queue_delay_us": max_queue_delay_us, "max_batch_size": max_batch_size}
    given = {k: v for k, v in wanted.items() if v is not None}
    if not given:
        return {"error": f"nothing to set: give one of {list(KNOBS)}"}
    for knob, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int):
            return {"error": f"{knob} must be an integer, got {value!r}"}
    if given.get("max_queue_delay_us", 0) < 0:
        return {"error": "max_queue_delay_us must be >= 0"}
    if "max_batch_size" in given and not 1 <= given["max_batch_size"] <= config.max_batch_size:
        return {"error": f"max_batch_size must be within 1..{config.max_batch_size} "
                         "(the configured bound)"}
    try:
        _redis.hset(Keys(_supervisor.settings.key_prefix).control(model),
                    mapping={k: v for k, v in given.items()})
    except REDIS_FAILED as exc:
        return {"error": f"Redis unreachable: {exc}"}
    return {"ok": True, "model": model, "set": given}
