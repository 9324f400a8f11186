"""The Celery configuration the API and the workers share, and the client that sends tasks by name.

The API queues job tasks (:data:`batching.job_record.JOB_TASK`) and the workers run them, so both
need the same broker, key prefix, routes, serializers and Redis TLS options, but the API
must not import :mod:`workers.app`, which pulls in the supervisor, the inference loop and
the backends. This module is their one home. It lives in ``conveyor/``, beside the
command line, because neither layer may hold it: ``batching/`` imports no Celery,
``api/`` never imports ``workers/`` and ``workers/`` never imports ``api/``; ``conveyor/``
imports only ``batching/`` here, so every side may import it. Tasks are sent by name, so
the sender never imports their code.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from celery import Celery

from batching.job_record import JOB_QUEUE, JOB_TASK
from batching.keys import Keys
from batching.redis_topology import parse_topology
from batching.settings import Settings
from batching.urls import mask_url


def celery_app(settings: Settings, name: str = "conveyor", current: bool = True) -> Celery:
    """A Celery app on the stack's Celery broker (``CONVEYOR_CELERY_BROKER_URL``, by
    default its Redis): what a client needs to send tasks, and the workers' base
    (:mod:`workers.app` adds the worker's own options). ``current=False`` for a second
    app in a process (the batch event sender) that must not become the default one.
    Raises ``ValueError`` for a broker Celery cannot use (a Redis Cluster)."""
    broker = settings.celery_broker()
    url, options = celery_url(broker)
    app = Celery(name, broker=url, backend=url, set_as_current=current)
    prefix = Keys(settings.key_prefix).celery()
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json", "msgpack"],
        event_serializer="json",
        task_send_sent_event=True,
        broker_connection_retry_on_startup=True,
        task_default_queue="cv.inference",
        task_routes={"conveyor.job*": {"queue": JOB_QUEUE}},
        result_expires=settings.job_result_ttl_s,
        broker_transport_options={"global_keyprefix": prefix, **options},
        result_backend_transport_options={"global_keyprefix": prefix, **options},
    )
    tls = parse_topology(broker).node.ssl_options()
    if tls is not None:  # rediss://: the URL's ssl_* options, ssl_cert_reqs=required by default
        app.conf.update(broker_use_ssl=tls, redis_backend_use_ssl=tls)
    return app


def celery_url(redis_url: str) -> tuple[str, dict[str, Any]]:
    """``redis_url`` in the form Celery's broker and result backend read, and the transport
    options it needs: a Unix socket (``unix:///path/redis.sock?db=N``) is kombu's
    ``redis+socket:///path?virtual_host=N``; a Sentinel URL is kombu's list
    ``sentinel://h1:26379/db;sentinel://h2:26379/db`` with the ``master_name`` option (and
    ``sentinel_kwargs`` for the sentinels' own login and TLS); a plain one is theirs
    already."""
    topology = parse_topology(redis_url)
    node = topology.node
    if topology.kind == "cluster":
        raise ValueError(
            f"Celery cannot use a Redis Cluster ({mask_url(redis_url)}): its Redis transport "
            "spreads one queue's keys over many slots. Set CONVEYOR_CELERY_BROKER_URL to a "
            "plain Redis or a Sentinel one (docs/configuration.md).")
    if topology.kind == "sentinel":
        login = _credentials(node.username, node.password)
        url = ";".join(f"sentinel://{login}{_host(host)}:{port}/{node.db}"
                       for host, port in topology.hosts)
        options: dict[str, Any] = {"master_name": topology.service}
        if topology.sentinel_kwargs():
            options["sentinel_kwargs"] = topology.sentinel_kwargs()
        return url, options
    if not redis_url.startswith("unix:"):
        return redis_url, {}
    return (f"redis+socket://{_credentials(node.username, node.password)}{node.path}"
            f"?virtual_host={node.db}"), {}


def _credentials(user: str | None, password: str | None) -> str:
    if not (user or password):
        return ""
    return f"{quote(user or '', safe='')}:{quote(password or '', safe='')}@"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def send_job(app: Celery, job_id: str, takeover: str = "") -> None:
    """Queues the job's task on ``cv.jobs``; the task id is the job id. ``takeover``: the
    lease token the job reaper holds when it resends a job whose worker died."""
    app.send_task(JOB_TASK, args=[job_id, takeover] if takeover else [job_id], task_id=job_id)
