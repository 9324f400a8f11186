"""``CONVEYOR_REDIS_URL=unix:///path/redis.sock?db=N``: every client of the stack on a Unix
socket, Celery's broker and result backend included (kombu spells it ``redis+socket://``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import redis

from conveyor.celery_client import celery_url
from tests.conftest import TEST_MODELS, Stack
from tests.procs import RedisServer


def test_celery_reads_a_unix_socket_url_in_its_own_form() -> None:
    assert celery_url("unix:///run/redis.sock?db=3") == (
        "redis+socket:///run/redis.sock?virtual_host=3", {})
    assert celery_url("unix:///run/redis.sock")[0] == "redis+socket:///run/redis.sock?virtual_host=0"
    assert (celery_url("unix://app:p%40ss@/run/redis.sock?db=1")[0]
            == "redis+socket://app:p%40ss@/run/redis.sock?virtual_host=1")
    assert celery_url("redis://127.0.0.1:6379/0") == ("redis://127.0.0.1:6379/0", {})


def test_a_stack_serves_over_a_unix_socket(tmp_path: Path, logdir: Path) -> None:
    sock = tmp_path / "redis.sock"
    server = RedisServer(tmp_path, "--unixsocket", str(sock), "--unixsocketperm", "700")
    stack = Stack(f"unix://{sock}?db=3", TEST_MODELS, logdir)
    try:
        url = stack.add_api()
        stack.add_worker()
        stack.wait_ready()
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                            "data": [1.0, 2.0, 3.0, 4.0]}]}
        response = httpx.post(f"{url}/v2/models/echo/infer", json=body, timeout=30)
        assert response.status_code == 200, response.text
        with redis.Redis(unix_socket_path=str(sock), db=3) as client:
            assert client.keys(f"{stack.prefix}:celery:*")  # the worker's Celery keys, db 3
            assert client.exists(f"{stack.prefix}:{{echo}}:q:1")
    finally:
        stack.stop()
        server.stop()
