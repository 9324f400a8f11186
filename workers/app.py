"""The Celery app: ``celery -A workers.app worker`` starts the inference supervisor.

JSON and msgpack only (no code-executing serializer). The inference processes are not
Celery tasks: a bootstep starts them beside the worker, so Celery keeps its main process for control
commands (:mod:`workers.control`), events and heartbeats, and shows the worker in Flower.
Job workers (``-Q cv.jobs --no-inference``) run the async job tasks of :mod:`workers.job_tasks`.
Celery's keys carry the key prefix too, so stacks sharing a Redis stay apart. The broker,
routes and TLS options come from :mod:`conveyor.celery_client`, which the API sends its tasks with.
"""

from __future__ import annotations

import os
from http.server import ThreadingHTTPServer
from typing import Any

from celery import bootsteps
from click import Option

from batching.settings import Settings
from conveyor.celery_client import celery_app
from workers import control, kombu_guard
from workers.events import NODE_ENV
from workers.job_tasks import JobReaper
from workers.probe import start_probe
from workers.supervisor import Supervisor

FLOWER_TASKS_COLUMNS = ("name,state,kwargs,result,exception,received,started,runtime,worker,"
                        "uuid")
"""The columns of Flower's tasks page when ``celery -A workers.app flower`` starts it
(Flower reads ``FLOWER_*`` variables after loading this module; set it to override):
beyond Flower's defaults, a batch's rows, how many batches a merged task stands for,
its outcome, and its start."""

kombu_guard.install()
app = celery_app(Settings())
app.conf.update(
    worker_send_task_events=True,
    worker_pool="solo",
    worker_concurrency=1,
    task_track_started=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
)

os.environ.setdefault("FLOWER_TASKS_COLUMNS", FLOWER_TASKS_COLUMNS)

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

    def info(self, parent: Any) -> dict[str, str]:  # type: ignore[override]
        """Added to ``celery inspect stats``: this worker's models and inference processes
        (Celery merges what each bootstep's ``info`` returns; celery-types says None)."""
        return control.worker_info()

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
