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

from urllib.parse import quote

from celery import Celery

from batching.job_record import JOB_QUEUE, JOB_TASK
from batching.keys import Keys
from batching.resp import Address
from batching.settings import Settings


def celery_app(settings: Settings, name: str = "conveyor", current: bool = True) -> Celery:
    """A Celery app on the stack's Redis: what a client needs to send tasks, and the
    workers' base (:mod:`workers.app` adds the worker's own options). ``current=False``
    for a second app in a process (the batch event sender) that must not become the
    default one."""
    url = celery_url(settings.redis_url)
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
        broker_transport_options={"global_keyprefix": prefix},
        result_backend_transport_options={"global_keyprefix": prefix},
    )
    tls = Address.from_url(settings.redis_url).ssl_options()
    if tls is not None:  # rediss://: the URL's ssl_* options, ssl_cert_reqs=required by default
        app.conf.update(broker_use_ssl=tls, redis_backend_use_ssl=tls)
    return app


def celery_url(redis_url: str) -> str:
    """``redis_url`` in the form Celery's broker and result backend read: a Unix socket
    (``unix:///path/redis.sock?db=N``) is kombu's ``redis+socket:///path?virtual_host=N``;
    every other form is theirs already."""
    if not redis_url.startswith("unix:"):
        return redis_url
    address = Address.from_url(redis_url)
    password = quote(address.password or "", safe="")
    user = quote(address.username or "", safe="")
    credentials = f"{user}:{password}@" if password or user else ""
    return f"redis+socket://{credentials}{address.path}?virtual_host={address.db}"


def send_job(app: Celery, job_id: str, takeover: str = "") -> None:
    """Queues the job's task on ``cv.jobs``; the task id is the job id. ``takeover``: the
    lease token the job reaper holds when it resends a job whose worker died."""
    app.send_task(JOB_TASK, args=[job_id, takeover] if takeover else [job_id], task_id=job_id)
