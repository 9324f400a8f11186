"""The redis-server ``conveyor run`` (``make run``) starts when none answers: an append-only
file synced every second in its own data folder, so a restart keeps the jobs and requests
written up to a second before; and a cluster given to Celery is refused before anything
starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from conveyor import launcher
from tests.procs import free_port, wait_for


def test_the_launched_redis_keeps_an_append_only_file_across_a_crash(tmp_path: Path) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    data = tmp_path / "data"
    server = launcher.start_redis(url, data)
    try:
        with redis.Redis.from_url(url) as client:
            config = client.config_get("append*")
            assert config["appendonly"] == "yes"
            assert config["appendfsync"] == "everysec"
            assert Path(client.config_get("dir")["dir"]) == data.resolve()
            client.set("kept", "1")
        wait_for(lambda: any(p.stat().st_size > 0 for p in data.rglob("*.aof*")), 10,
                 "the append-only file to hold the write")
        time.sleep(1.5)  # appendfsync everysec: the write is on disk within a second
    finally:
        server.kill_group()  # SIGKILL: no shutdown save
    server = launcher.start_redis(url, data)
    try:
        with redis.Redis.from_url(url) as client:
            assert client.get("kept") == b"1"
    finally:
        server.kill_group()


def test_the_default_data_folder_is_per_port() -> None:
    assert launcher.redis_data_folder(6380) == Path(".run/redis-6380")


def test_run_refuses_a_cluster_as_celery_broker(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CONVEYOR_REDIS_URL", "redis+cluster://127.0.0.1:1,127.0.0.1:2")
    monkeypatch.delenv("CONVEYOR_CELERY_BROKER_URL", raising=False)
    assert launcher.run() == 2
    assert "CONVEYOR_CELERY_BROKER_URL" in capsys.readouterr().err
