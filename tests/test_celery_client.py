"""The Celery client the API queues jobs with: the workers' broker, prefix, routes and TLS."""

from __future__ import annotations

import ssl
from typing import Any
from unittest.mock import patch

from batching.job_record import JOB_QUEUE, JOB_TASK
from batching.settings import Settings
from conveyor.celery_client import celery_app, send_job


def test_client_follows_the_settings() -> None:
    app = celery_app(Settings(redis_url="redis://cache:6380/2", key_prefix="blue"))
    assert app.conf.broker_url == "redis://cache:6380/2"
    assert app.conf.broker_transport_options == {"global_keyprefix": "blue:celery:"}
    assert app.conf.result_backend_transport_options == {"global_keyprefix": "blue:celery:"}
    assert app.amqp.router.route({}, JOB_TASK)["queue"].name == JOB_QUEUE
    assert not app.conf.broker_use_ssl


def test_rediss_urls_carry_their_tls_options_to_broker_and_backend() -> None:
    app = celery_app(Settings(redis_url="rediss://cache?ssl_certfile=/c.pem&ssl_keyfile=/c.key"))
    for options in (app.conf.broker_use_ssl, app.conf.redis_backend_use_ssl):
        assert options["ssl_cert_reqs"] == ssl.CERT_REQUIRED
        assert (options["ssl_certfile"], options["ssl_keyfile"]) == ("/c.pem", "/c.key")


def test_a_job_is_sent_by_name_with_its_id_as_task_id() -> None:
    app = celery_app(Settings())
    sent: list[tuple[Any, ...]] = []
    with patch.object(app, "send_task", lambda *a, **k: sent.append((a, k))):
        send_job(app, "abc")
        send_job(app, "abc", "reaper-1")
    assert sent == [((JOB_TASK,), {"args": ["abc"], "task_id": "abc"}),
                    ((JOB_TASK,), {"args": ["abc", "reaper-1"], "task_id": "abc"})]


def test_batch_events_use_the_same_tls_options() -> None:
    from workers.events import BatchEvents

    url = "rediss://cache?ssl_certfile=/c.pem&ssl_keyfile=/c.key"
    events = BatchEvents("digits", Settings(redis_url=url))
    assert events.app.conf.broker_use_ssl == celery_app(Settings(redis_url=url)).conf.broker_use_ssl
    assert events.app.conf.broker_use_ssl["ssl_certfile"] == "/c.pem"
    plain = BatchEvents("digits", Settings(redis_url="redis://cache"))
    assert not plain.app.conf.broker_use_ssl
