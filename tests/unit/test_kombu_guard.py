"""workers.kombu_guard: a channel whose connection closed fails as a connection error."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kombu import Connection
from kombu.transport import redis as kombu_redis

from workers import kombu_guard


def closed_channel(cls: Any) -> Any:
    channel = cls.__new__(cls)  # no broker needed: only its connection matters here
    channel.connection = SimpleNamespace(client=None, default_port=6379)
    return channel


@pytest.mark.parametrize("cls", [kombu_redis.Channel, kombu_redis.SentinelChannel])
def test_a_closed_connection_is_a_connection_error_celery_catches(cls: Any) -> None:
    kombu_guard.install()
    kombu_guard.install()  # twice: still one guard
    with pytest.raises(ConnectionError):
        closed_channel(cls)._connparams()
    # what Celery's late ack catches (Request.acknowledge: the transport's connection errors)
    assert issubclass(ConnectionError, kombu_redis.Transport.connection_errors)


def test_an_open_connection_is_untouched() -> None:
    kombu_guard.install()
    channel = closed_channel(kombu_redis.Channel)
    channel.connection = SimpleNamespace(client=Connection("redis://10.0.0.9:6390/0"),
                                         default_port=6379)
    assert channel._connparams()["host"] == "10.0.0.9"
