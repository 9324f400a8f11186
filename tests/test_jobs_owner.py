"""Jobs belong to the key that submitted them; callback URLs are checked at submission.

A real API process against a real redis-server, with no job worker: jobs stay PENDING,
which is all ownership needs. (The API is not imported here: ``api.main`` imports
``api.proto``, whose symbols collide with tritonclient's in a test process.)
"""

from __future__ import annotations

import argparse
import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from api.auth import key_digest
from conveyor import jobs_cli
from tests.conftest import TEST_MODELS, Stack
from tests.procs import RedisServer

KEYS = "alice-key jobs\nbob-key jobs,infer\nroot-key admin\nscorer-key infer\n"
ROWS = {"model": "echo", "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                                     "data": [0.0] * 8}]}


def api_stack(redis_server: RedisServer, logdir: Path, **env: str) -> Stack:
    stack = Stack(redis_server.url, TEST_MODELS, logdir,
                  extra_env={"CONVEYOR_MODELS": "echo", **env})
    stack.add_api()
    return stack


@pytest.fixture(scope="module")
def keyed(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    keys = tmp_path_factory.mktemp("owner") / "keys"
    keys.write_text(KEYS)
    stack = api_stack(redis_server, logdir, CONVEYOR_API_KEYS_FILE=str(keys))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def open_api(redis_server: RedisServer, logdir: Path) -> Iterator[Stack]:
    stack = api_stack(redis_server, logdir, CONVEYOR_CALLBACK_HOSTS="localhost,93.184.216.34")
    yield stack
    stack.stop()


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def submit(stack: Stack, key: str | None, **parameters: Any) -> str:
    response = httpx.post(f"{stack.url}/v1/jobs", json={**ROWS, "parameters": parameters},
                          headers=auth(key), timeout=30)
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


def listed(stack: Stack, key: str | None, **params: int) -> list[str]:
    response = httpx.get(f"{stack.url}/v1/jobs", params=params, headers=auth(key))
    assert response.status_code == 200, response.text
    return [job["id"] for job in response.json()["jobs"]]


def test_only_the_submitting_key_or_an_admin_key_sees_lists_and_cancels_a_job(
        keyed: Stack) -> None:
    url = keyed.url
    mine = submit(keyed, "alice-key")
    theirs = submit(keyed, "bob-key")
    unknown = uuid.uuid4().hex
    for path in (f"/v1/jobs/{mine}", f"/v1/jobs/{mine}/result"):
        other = httpx.get(f"{url}{path}", headers=auth("bob-key"))
        missing = httpx.get(f"{url}{path.replace(mine, unknown)}", headers=auth("bob-key"))
        assert other.status_code == missing.status_code == 404
        assert other.json()["error"] == missing.json()["error"].replace(unknown, mine)
    assert httpx.delete(f"{url}/v1/jobs/{mine}", headers=auth("bob-key")).status_code == 404
    seen = httpx.get(f"{url}/v1/jobs/{mine}", headers=auth("alice-key"))
    assert seen.status_code == 200 and seen.json()["state"] == "PENDING"
    assert "owner" not in seen.json()
    assert httpx.get(f"{url}/v1/jobs/{mine}", headers=auth("root-key")).status_code == 200

    assert listed(keyed, "alice-key") == [mine]
    assert listed(keyed, "bob-key") == [theirs]
    assert listed(keyed, "root-key")[:2] == [theirs, mine]
    assert listed(keyed, "root-key", limit=1, offset=1) == [mine]
    for bad in ({"limit": 0}, {"offset": 2**100}, {"offset": -1}):
        answer = httpx.get(f"{url}/v1/jobs", params=bad, headers=auth("root-key"))
        assert answer.status_code == 400, (bad, answer.text)
    assert httpx.get(f"{url}/v1/jobs", headers=auth("scorer-key")).status_code == 403

    cancelled = httpx.delete(f"{url}/v1/jobs/{mine}", headers=auth("alice-key"))
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "CANCELLED"

    stored = keyed.redis()
    owners = {stored.hget(f"{keyed.prefix}:job:{{{job}}}", "owner") for job in (mine, theirs)}
    assert owners == {key_digest("alice-key").encode(), key_digest("bob-key").encode()}
    dump = b"".join(v for key in stored.scan_iter(f"{keyed.prefix}:*") if stored.type(key) == b"hash"
                    for v in cast(dict[bytes, bytes], stored.hgetall(key)).values())
    assert b"alice-key" not in dump and b"bob-key" not in dump


def test_without_keys_jobs_have_no_owner_and_everyone_sees_them(open_api: Stack) -> None:
    job_id = submit(open_api, None)
    assert httpx.get(f"{open_api.url}/v1/jobs/{job_id}").status_code == 200
    assert job_id in listed(open_api, None)
    assert open_api.redis().hget(f"{open_api.prefix}:job:{{{job_id}}}", "owner") == b""


@pytest.mark.parametrize(("url", "words"), [
    ("http://127.0.0.1:9/", "not in CONVEYOR_CALLBACK_HOSTS"),
    ("http://evil.example.com/", "not in CONVEYOR_CALLBACK_HOSTS"),
    ("http://localhost:9/", "non-public address"),
    ("gopher://93.184.216.34/", "http or https"),
])
def test_a_callback_url_outside_the_policy_is_a_400_naming_the_reason(
        open_api: Stack, url: str, words: str) -> None:
    response = httpx.post(f"{open_api.url}/v1/jobs",
                          json={**ROWS, "parameters": {"callback_url": url}})
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]


def test_a_callback_url_inside_the_policy_is_accepted(open_api: Stack) -> None:
    submit(open_api, None, callback_url="https://93.184.216.34/hook")


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
