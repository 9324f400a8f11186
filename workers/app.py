"""The Celery app: ``celery -A workers.app worker`` starts the inference supervisor.

JSON and msgpack only, never pickle. The inference processes are not Celery tasks: a
bootstep starts them beside the worker, so Celery keeps its main process for control
commands, events and heartbeats, and shows the worker in Flower.
"""

from __future__ import annotations

from http.server import ThreadingHTTPServer
from typing import Any

from celery import Celery, bootsteps
from click import Option

from batching.settings import Settings
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
    worker_hijack_root_logger=False,
)

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
        self.supervisor = Supervisor(settings)
        self.supervisor.start()
        if settings.worker_port:
            self.probe = start_probe(self.supervisor, settings.worker_port)

    def stop(self, parent: Any) -> None:
        if self.probe is not None:
            self.probe.shutdown()
            self.probe = None
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None


app.steps["worker"].add(InferenceStep)
