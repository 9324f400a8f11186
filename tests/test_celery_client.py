"""The Celery client the API queues jobs with: the workers' broker, prefix, routes and TLS."""

from __future__ import annotations

import base64
import json
import ssl

import pytest
import redis

from batching.job_record import JOB_QUEUE, JOB_TASK
from batching.keys import Keys
from batching.settings import Settings
from conveyor.celery_client import celery_app, send_job
from tests.procs import RedisServer


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


def test_a_job_is_sent_by_name_with_its_id_as_task_id(redis_server: RedisServer,
                                                      keys: Keys) -> None:
    """Two jobs sent through a real broker: each message on cv.jobs names the task, carries
    the job id as task id and the arguments (the reaper's lease token when it resends)."""
    app = celery_app(Settings(redis_url=redis_server.url, key_prefix=keys.prefix))
    try:
        send_job(app, "abc")
        send_job(app, "abc", "reaper-1")
    finally:
        app.close()
    with redis.Redis.from_url(redis_server.url) as client:
        raw = client.lrange(f"{keys.celery()}{JOB_QUEUE}", 0, -1)
    messages = sorted((json.loads(m) for m in raw), key=lambda m: len(m["headers"]["argsrepr"]))
    assert [(m["headers"]["task"], m["headers"]["id"]) for m in messages] == [
        (JOB_TASK, "abc"), (JOB_TASK, "abc")]
    assert [json.loads(base64.b64decode(m["body"]))[0] for m in messages] == [
        ["abc"], ["abc", "reaper-1"]]


def test_batch_events_use_the_same_tls_options() -> None:
    from workers.events import BatchEvents

    url = "rediss://cache?ssl_certfile=/c.pem&ssl_keyfile=/c.key"
    events = BatchEvents("digits", Settings(redis_url=url))
    assert events.app.conf.broker_use_ssl == celery_app(Settings(redis_url=url)).conf.broker_use_ssl
    assert events.app.conf.broker_use_ssl["ssl_certfile"] == "/c.pem"
    plain = BatchEvents("digits", Settings(redis_url="redis://cache"))
    assert not plain.app.conf.broker_use_ssl


def test_celery_gets_its_own_broker_url_when_one_is_set() -> None:
    app = celery_app(Settings(redis_url="redis://data:6379/0",
                              celery_broker_url="redis://broker:6380/1"))
    assert app.conf.broker_url == "redis://broker:6380/1"
    assert app.conf.result_backend == "redis://broker:6380/1"


def test_a_sentinel_url_is_kombus_list_with_the_primary_named() -> None:
    app = celery_app(Settings(
        redis_url="redis+sentinel://:pw@s1:26379,s2:26380/mymaster/2?sentinel_password=sp",
        key_prefix="blue"))
    assert app.conf.broker_url == "sentinel://:pw@s1:26379/2;sentinel://:pw@s2:26380/2"
    assert app.conf.result_backend == app.conf.broker_url
    expected = {"global_keyprefix": "blue:celery:", "master_name": "mymaster",
                "sentinel_kwargs": {"password": "sp"}}
    assert app.conf.broker_transport_options == expected
    assert app.conf.result_backend_transport_options == expected


def test_a_cluster_broker_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="CONVEYOR_CELERY_BROKER_URL") as refused:
        celery_app(Settings(redis_url="redis+cluster://:secret@n1:7000,n2:7001"))
    assert "secret" not in str(refused.value)
    app = celery_app(Settings(redis_url="redis+cluster://n1:7000",
                              celery_broker_url="redis://broker:6379/0"))
    assert app.conf.broker_url == "redis://broker:6379/0"
