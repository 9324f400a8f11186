"""``conveyor models``: the repository state for operators, straight from Redis.

    conveyor models list            # folders, recorded state, what the workers report
    conveyor models load NAME       # record NAME loaded (as the API's load does)
    conveyor models unload NAME     # record NAME unloaded
    conveyor models reset [NAME]    # forget the recorded state of NAME, or of every model

It reads ``CONVEYOR_REDIS_URL``, ``CONVEYOR_KEY_PREFIX`` and ``CONVEYOR_MODEL_REPOSITORY``
like the services, and works whatever ``CONVEYOR_MODEL_CONTROL`` says: the API and the
workers follow the recorded state within a heartbeat interval. After a reset, a model
is loaded when its folder is in the repository as the services start, like one never
loaded or unloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import redis

from batching.keys import Keys
from batching.names import model_folder
from batching.redis_topology import sync_redis
from batching.repository_scan import (
    as_text,
    parse_record,
    record_value,
    scan_repository,
    status_table,
)
from batching.settings import Settings
from batching.urls import mask_url


def add_parser(commands: Any) -> None:
    """Add the ``models`` command group to the ``conveyor`` parser's subcommands."""
    models = commands.add_parser("models", help="list, load, unload or reset the models' "
                                 "recorded repository state (in Redis)")
    sub = models.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="model folders, recorded state and worker state")
    for action, text in (("load", "record a model loaded"), ("unload", "record it unloaded")):
        sub.add_parser(action, help=text).add_argument("name")
    reset = sub.add_parser("reset", help="forget the recorded state of one model, or of all")
    reset.add_argument("name", nargs="?")


def run(args: argparse.Namespace) -> int:
    settings = Settings()
    client = sync_redis(settings.redis_url, socket_connect_timeout=2.0,
                                  socket_timeout=5.0)
    keys = Keys(settings.key_prefix)
    try:
        if args.action == "list":
            print(listing(client, keys, settings))
            return 0
        if args.action == "reset":
            return reset(client, keys, args.name)
        return record(client, keys, settings, args.name, f"{args.action}ed")
    except (redis.RedisError, OSError) as exc:
        print(f"conveyor models: Redis at {mask_url(settings.redis_url)} is unreachable: "
              f"{type(exc).__name__}", file=sys.stderr)
        return 1
    finally:
        client.close()


def listing(client: redis.Redis, keys: Keys, settings: Settings) -> str:
    """One row per model folder or recorded name: its folder, recorded and worker state."""
    scan = scan_repository(settings.model_repository, settings.model_filter() or None)
    recorded = {as_text(k): parse_record(v).state or "?"
                for k, v in client.hgetall(keys.repository()).items()}
    rows = []
    for name in sorted({*scan.models, *scan.failed, *recorded}):
        if name in scan.models:
            folder = "ok"
        elif name in scan.failed:
            folder = f"invalid: {scan.failed[name]}"
        else:
            folder = "absent"
        workers = (_workers(client, keys, name, settings.heartbeat_stale_s)
                   if model_folder(settings.model_repository, name) else "-")
        rows.append((name, f"folder {folder}; recorded {recorded.get(name, '-')}; "
                           f"workers {workers}"))
    return status_table(rows)


def record(client: redis.Redis, keys: Keys, settings: Settings, name: str, state: str) -> int:
    if model_folder(settings.model_repository, name) is None:
        print(f"conveyor models: unknown model {name[:128]!r} (no such folder in "
              f"{settings.model_repository})", file=sys.stderr)
        return 1
    client.hset(keys.repository(), name, record_value(state, time.time()))
    print(f"{name}: recorded {state}")
    return 0


def reset(client: redis.Redis, keys: Keys, name: str | None) -> int:
    if name is None:
        count = client.hlen(keys.repository())
        client.delete(keys.repository())
        print(f"forgot the recorded state of {count} models")
    else:
        found = client.hdel(keys.repository(), name)
        print(f"{name}: " + ("recorded state forgotten" if found else "nothing was recorded"))
    return 0


def _workers(client: redis.Redis, keys: Keys, name: str, stale_s: float) -> str:
    """What the model's fresh heartbeats say, e.g. ``2 ready`` or ``1 failed (why)``."""
    now = time.time()
    counts: dict[str, int] = {}
    reasons = set()
    for raw in client.hvals(keys.workers(name)):
        beat = json.loads(raw)
        if now - float(beat.get("ts", 0)) > stale_s:
            continue
        counts[beat.get("state", "?")] = counts.get(beat.get("state", "?"), 0) + 1
        if beat.get("reason"):
            reasons.add(str(beat["reason"]))
    if not counts:
        return "none"
    text = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    return text + (f" ({'; '.join(sorted(reasons))})" if reasons else "")
