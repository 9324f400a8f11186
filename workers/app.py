"""The Celery app: ``celery -A workers.app worker`` starts the inference supervisor.

JSON and msgpack only (no code-executing serializer). The inference processes are not
Celery tasks: a bootstep starts them beside the worker, so Celery keeps its main process for control
commands (:mod:`workers.control`), events and heartbeats, and shows the worker in Flower.
Job workers (``-Q cv.jobs --no-inference``) run the async job tasks of :mod:`workers.jobs`.
Celery's keys carry the key prefix too, so stacks sharing a Redis stay apart.
"""

from __future__ import annotations

import os
from http.server import ThreadingHTTPServer
from typing import Any

from celery import Celery, bootsteps
from click import Option

from batching.jobs import JOB_QUEUE
from batching.keys import Keys
from batching.resp import Address
from batching.settings import Settings
from workers import control
from workers.events import NODE_ENV
from workers.jobs import JobReaper
from workers.probe import start_probe
from workers.supervisor import Supervisor

settings = Settings()

app = Celery("conveyor", broker=settings.redis_url, backend=settings.redis_url)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json", "msgpack"],
    event_serializer="json",
    worker_send_task_events=True,
    task_send_sent_event=True,
    worker_pool="solo",
    worker_concurrency=1,
    broker_connection_retry_on_startup=True,
    task_default_queue="cv.inference",
    task_routes={"conveyor.job*": {"queue": JOB_QUEUE}},
    task_track_started=True,
    worker_prefetch_multiplier=1,
    result_expires=settings.job_result_ttl_s,
    broker_transport_options={"global_keyprefix": Keys(settings.key_prefix).celery()},
    result_backend_transport_options={"global_keyprefix": Keys(settings.key_prefix).celery()},
    worker_hijack_root_logger=False,
)
_tls = Address.from_url(settings.redis_url).ssl_options()
if _tls is not None:  # rediss://: the URL's ssl_* options, ssl_cert_reqs=required by default
    app.conf.update(broker_use_ssl=_tls, redis_backend_use_ssl=_tls)

app.user_options["worker"].add(Option(
    ["--inference/--no-inference"], default=True,
    help="Start the conveyor inference processes (off for job-only workers)."))


class InferenceStep(bootsteps.StartStopStep):
    """Starts and stops the inference supervisor with the worker."""

    def __init__(self, parent: Any, inference: bool = True, **options: Any) -> None:
        super().__init__(parent, **options)
        self.enabled = inference
        self.supervisor: Supervisor | None = None
        self.probe: ThreadingHTTPServer | None = None

    def start(self, parent: Any) -> None:
        settings = Settings()
        os.environ[NODE_ENV] = parent.hostname  # inference processes send batch events as us
        self.supervisor = Supervisor(settings)
        self.supervisor.start()
        control.attach(self.supervisor)
        if settings.worker_port:
            self.probe = start_probe(self.supervisor, settings.host, settings.worker_port)

    def stop(self, parent: Any) -> None:
        if self.probe is not None:
            self.probe.shutdown()
            self.probe = None
        if self.supervisor is not None:
            control.attach(None)
            self.supervisor.stop()
            self.supervisor = None


app.steps["worker"].add(InferenceStep)
app.steps["worker"].add(JobReaper)
