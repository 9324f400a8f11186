"""Jobs belong to the key that submitted them; callback URLs are checked at submission.

The real app in-process (httpx over ASGI, one event loop) against a real redis-server;
the Celery task is recorded instead of sent, so jobs stay PENDING.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import uuid
from collections.abc import Awaitable, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

import api.jobs
from api.auth import key_digest
from api.main import create_app
from batching.settings import Settings
from conveyor import jobs_cli
from tests.conftest import TEST_MODELS
from tests.procs import RedisServer, free_port

KEYS = "alice-key jobs\nbob-key jobs,infer\nroot-key admin\nscorer-key infer\n"
ROWS = {"model": "echo", "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                                     "data": [0.0] * 8}]}

Scenario = Callable[[httpx.AsyncClient], Awaitable[None]]


@pytest.fixture(autouse=True)
def no_celery(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    sent: list[str] = []

    def send_task(name: str, args: list[Any], task_id: str) -> None:
        sent.append(task_id)
    monkeypatch.setattr(api.jobs.celery_app, "send_task", send_task)
    return sent


def run(settings: Settings, scenario: Scenario) -> None:
    async def main() -> None:
        transport = httpx.ASGITransport(app=create_app(settings))
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            await scenario(client)
    asyncio.run(main())


def settings_for(redis_server: RedisServer, tmp_path: Path, keys: str | None = KEYS,
                 **extra: Any) -> Settings:
    keys_file = None
    if keys is not None:
        keys_file = tmp_path / "keys"
        keys_file.write_text(keys)
    return Settings(redis_url=redis_server.url, key_prefix=f"t{uuid.uuid4().hex[:8]}",
                    model_repository=TEST_MODELS, models="echo", grpc_port=free_port(),
                    api_keys_file=keys_file, **extra)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def submit(client: httpx.AsyncClient, key: str | None, **parameters: Any) -> str:
    response = await client.post("/v1/jobs", json={**ROWS, "parameters": parameters},
                                 headers=auth(key) if key else {})
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


def test_only_the_submitting_key_or_an_admin_key_sees_lists_and_cancels_a_job(
        redis_server: RedisServer, tmp_path: Path) -> None:
    settings = settings_for(redis_server, tmp_path)

    async def scenario(client: httpx.AsyncClient) -> None:
        mine = await submit(client, "alice-key")
        theirs = await submit(client, "bob-key")
        unknown = uuid.uuid4().hex
        for path in (f"/v1/jobs/{mine}", f"/v1/jobs/{mine}/result"):
            other = await client.get(path, headers=auth("bob-key"))
            missing = await client.get(path.replace(mine, unknown), headers=auth("bob-key"))
            assert other.status_code == missing.status_code == 404
            assert other.json()["error"] == missing.json()["error"].replace(unknown, mine)
        assert (await client.delete(f"/v1/jobs/{mine}", headers=auth("bob-key"))).status_code \
            == 404
        seen = await client.get(f"/v1/jobs/{mine}", headers=auth("alice-key"))
        assert seen.status_code == 200 and seen.json()["state"] == "PENDING"
        assert "owner" not in seen.json()
        assert (await client.get(f"/v1/jobs/{mine}", headers=auth("root-key"))).status_code \
            == 200

        async def listed(key: str) -> list[str]:
            response = await client.get("/v1/jobs", headers=auth(key))
            assert response.status_code == 200, response.text
            return [job["id"] for job in response.json()["jobs"]]
        assert await listed("alice-key") == [mine]
        assert await listed("bob-key") == [theirs]
        assert await listed("root-key") == [theirs, mine]
        page = await client.get("/v1/jobs", params={"limit": 1, "offset": 1},
                                headers=auth("root-key"))
        assert [job["id"] for job in page.json()["jobs"]] == [mine]
        assert (await client.get("/v1/jobs", params={"limit": 0},
                                 headers=auth("root-key"))).status_code == 400

        cancelled = await client.delete(f"/v1/jobs/{mine}", headers=auth("alice-key"))
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "CANCELLED"
        assert (await client.get("/v1/jobs", headers=auth("scorer-key"))).status_code == 403

    run(settings, scenario)
    stored = redis.Redis.from_url(redis_server.url)
    owners = {stored.hget(key, "owner") for key in stored.scan_iter(f"{settings.key_prefix}:job:*")
              if stored.type(key) == b"hash"}
    assert owners == {key_digest("alice-key").encode(), key_digest("bob-key").encode()}
    dump = b"".join(v for key in stored.scan_iter(f"{settings.key_prefix}:*")
                    if stored.type(key) == b"hash" for v in stored.hgetall(key).values())
    assert b"alice-key" not in dump


def test_without_keys_jobs_have_no_owner_and_everyone_sees_them(
        redis_server: RedisServer, tmp_path: Path) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        job_id = await submit(client, None)
        assert (await client.get(f"/v1/jobs/{job_id}")).status_code == 200
        listed = (await client.get("/v1/jobs")).json()["jobs"]
        assert [job["id"] for job in listed] == [job_id]

    run(settings_for(redis_server, tmp_path, keys=None), scenario)


def test_a_callback_url_outside_the_policy_is_a_400_naming_the_reason(
        redis_server: RedisServer, tmp_path: Path) -> None:
    settings = settings_for(redis_server, tmp_path, keys=None,
                            callback_hosts="localhost,93.184.216.34")

    async def scenario(client: httpx.AsyncClient) -> None:
        for url, words in [("http://127.0.0.1:9/", "not in CONVEYOR_CALLBACK_HOSTS"),
                           ("http://evil.example.com/", "not in CONVEYOR_CALLBACK_HOSTS"),
                           ("http://localhost:9/", "non-public address"),
                           ("gopher://93.184.216.34/", "http or https")]:
            response = await client.post("/v1/jobs", json={
                **ROWS, "parameters": {"callback_url": url}})
            assert response.status_code == 400, (url, response.text)
            assert words in response.json()["error"], (url, response.text)
        await submit(client, None, callback_url="https://93.184.216.34/hook")

    run(settings, scenario)


def test_the_cli_sends_conveyor_api_key_as_the_bearer_key(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[str | None] = []

    class Api(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"jobs": [], "path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = argparse.Namespace(action="list", url=f"http://127.0.0.1:{server.server_port}",
                                  limit=5)
        monkeypatch.setenv("CONVEYOR_API_KEY", "alice-key")
        assert jobs_cli.run(args) == 0
        monkeypatch.delenv("CONVEYOR_API_KEY")
        assert jobs_cli.run(args) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["Bearer alice-key", None]
    assert '"/v1/jobs?limit=5"' in capsys.readouterr().out
