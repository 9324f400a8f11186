"""``GET /v2/conveyor/queues``: where the work waits, for an operator.

Requests wait in each model's Redis streams (one per priority level), not in Celery's
queues, so Flower's Broker page never shows them. This page reads them at request time,
in one round trip: per stream its entries (``XLEN``), those an inference process has read
and not answered yet (``running``: the consumer group's pending entries) and the rest
(``waiting``); per model the rows counted against ``max_queue_rows`` (summed over its
partitions) and the dead-letter stream's length. A model with several partitions
(``queue.partitions``) lists each partition's streams, each naming its partition. JSON,
or an HTML table when the client asks for ``text/html`` (a browser). Like ``/metrics``,
which carries the same depths, it is open unless ``CONVEYOR_AUTH_METRICS=1``.
"""

from __future__ import annotations

import html
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from api.service import InferenceService
from batching.errors import Unavailable
from batching.keys import GROUP
from batching.redis_errors import REDIS_FAILED

PATH = "/v2/conveyor/queues"


def queues_router(service: InferenceService) -> APIRouter:
    router = APIRouter()

    @router.get(PATH)
    async def queues(request: Request) -> Response:
        depths = await read_queues(service)
        if "text/html" in request.headers.get("accept", ""):
            return HTMLResponse(render_html(depths))
        return JSONResponse(depths)

    return router


async def read_queues(service: InferenceService) -> dict[str, Any]:
    """Every served model's streams, read in one pipeline."""
    keys, models = service.keys, service.models
    names = sorted(models)
    streams = [(model, p, part) for model in names
               for p in range(1, models[model].queue.priority_levels + 1)
               for part in range(models[model].queue.partitions)]
    pipe = service.dispatcher.redis.pipeline(transaction=False)
    for model, priority, part in streams:
        pipe.xlen(keys.queue(model, priority, part))
        pipe.xinfo_groups(keys.queue(model, priority, part))
    for model in names:
        for part in range(models[model].queue.partitions):
            pipe.get(keys.rows_waiting(model, part))
        pipe.xlen(keys.dead_letter(model))
    try:
        # A stream nobody wrote to yet has no group: XINFO answers an error, read as none.
        results = await pipe.execute(raise_on_error=False)
    except REDIS_FAILED as exc:
        raise Unavailable(f"Redis unreachable: {exc}") from exc
    per_stream, per_model = results[:2 * len(streams)], iter(results[2 * len(streams):])
    found: dict[str, dict[str, Any]] = {}
    for model in names:
        rows = sum(_int(next(per_model)) for _ in range(models[model].queue.partitions))
        found[model] = {"name": model, "max_queue_rows": models[model].queue.max_queue_rows,
                        "rows_waiting": rows, "dead_letter": _int(next(per_model)),
                        "streams": []}
    for (model, priority, part), length, groups in zip(streams, per_stream[::2],
                                                       per_stream[1::2], strict=True):
        entries = _int(length)
        group = _group(groups)
        running = min(entries, _int(group.get("pending")))
        # "partition" only where there are several: one partition's page reads as before.
        where = {"partition": part} if models[model].queue.partitions > 1 else {}
        found[model]["streams"].append({
            "priority": priority, **where, "stream": keys.queue(model, priority, part),
            "entries": entries, "waiting": entries - running, "running": running})
    return {"read_at": round(time.time(), 3), "models": list(found.values())}


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | bytes | str) and value else 0


def _group(groups: Any) -> dict[str, Any]:
    """The inference processes' consumer group among a stream's (XINFO GROUPS), or {}."""
    if not isinstance(groups, list):
        return {}
    for group in groups:
        name = group.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == GROUP:
            return dict(group)
    return {}


def render_html(depths: dict[str, Any]) -> str:
    rows = []
    for model in depths["models"]:
        name = html.escape(model["name"])
        for stream in model["streams"]:
            rows.append(
                f"<tr><td>{name}</td><td>{stream['priority']}</td>"
                f"<td><code>{html.escape(stream['stream'])}</code></td>"
                f"<td>{stream['waiting']}</td><td>{stream['running']}</td></tr>")
        rows.append(
            f"<tr class='total'><td>{name}</td><td colspan='2'>rows waiting / limit"
            f"</td><td colspan='2'>{model['rows_waiting']} / {model['max_queue_rows']}</td></tr>")
        rows.append(
            f"<tr class='total'><td>{name}</td><td colspan='2'>dead-letter stream</td>"
            f"<td colspan='2'>{model['dead_letter']}</td></tr>")
    read_at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(depths["read_at"]))
    return f"""<!doctype html>
<html><head><meta charset="utf-8">
<title>conveyor: model queues</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: left; }}
th {{ background: #eee; }} tr.total td {{ background: #f6f6f6; }}
</style></head><body>
<h1>Model queues</h1>
<p>Requests and job chunks wait in each model's Redis streams (one per priority, 1 first).
<em>waiting</em>: not read by an inference process yet; <em>running</em>: read, not answered.
Read at {read_at}; reload the page to read again.</p>
<table><tr><th>model</th><th>priority</th><th>stream</th><th>waiting</th><th>running</th></tr>
{"".join(rows)}
</table></body></html>
"""
