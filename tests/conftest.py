"""Fixtures: a real redis-server per test session (on a free port), real API and workers.

Each stack gets its own key prefix, so stacks sharing one Redis never see each other.
Every test that starts a process (these fixtures, tests/procs.py, any subprocess) is
marked ``integration`` at collection (tests/integration_marks.py); ``make test-unit``
leaves those out.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import pytest
import redis

from batching.keys import Keys
from tests.integration_marks import starts_processes
from tests.procs import ROOT, Proc, RedisServer, service_env, start_api, start_worker, wait_for

TEST_MODELS = ROOT / "tests" / "models"
MODELS = ROOT / "models"


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    known: dict[int, bool] = {}
    for item in items:
        if item.get_closest_marker("integration") is None and starts_processes(item, known):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def redis_server(logdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(logdir)
    yield server
    server.stop()


@pytest.fixture
def keys() -> Keys:
    """Redis keys under a prefix of this test's own, on the shared ``redis_server``."""
    return Keys(f"t{uuid.uuid4().hex[:8]}")


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A redis-py client of the shared ``redis_server``, closed after the test."""
    with redis.Redis.from_url(redis_server.url) as client:
        yield client


@dataclass
class Stack:
    """An API and its workers against one Redis, under one key prefix."""

    redis_url: str
    repository: Path
    logdir: Path
    prefix: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:8]}")
    extra_env: dict[str, str] = field(default_factory=dict)
    apis: list[tuple[Proc, str]] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return service_env(self.redis_url, self.repository, self.prefix, **self.extra_env)

    @property
    def url(self) -> str:
        return self.apis[0][1]

    def add_api(self) -> str:
        proc, url = start_api(self.env, self.logdir, f"api-{self.prefix}-{len(self.apis)}")
        self.apis.append((proc, url))
        return url

    def add_worker(self) -> Proc:
        proc = start_worker(self.env, self.logdir, f"worker-{self.prefix}-{len(self.workers)}")
        self.workers.append(proc)
        return proc

    def wait_ready(self, timeout: float = 60) -> None:
        def ready() -> bool:
            return all(httpx.get(f"{url}/v2/health/ready").status_code == 200
                       for _, url in self.apis)
        try:
            wait_for(ready, timeout, "the API to be ready")
        except AssertionError:
            logs = "\n".join(p.log()[-3000:] for p in self.workers)
            raise AssertionError(f"not ready; worker logs:\n{logs}") from None

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def stop(self) -> None:
        for proc in self.workers:
            proc.stop()
        for proc, _ in self.apis:
            proc.stop()


class MakeStack(Protocol):
    """The ``make_stack`` fixture: a stack serving ``repository`` with ``env`` on top of the usual."""

    def __call__(self, repository: Path = ..., **env: str) -> Stack: ...


@pytest.fixture
def make_stack(redis_server: RedisServer, logdir: Path) -> Iterator[MakeStack]:
    """Build stacks inside a test; every stack made is stopped afterwards."""
    made: list[Stack] = []

    def factory(repository: Path = TEST_MODELS, **env: str) -> Stack:
        stack = Stack(redis_server.url, repository, logdir, extra_env=env)
        made.append(stack)
        return stack

    yield factory
    for stack in made:
        stack.stop()


@pytest.fixture(scope="module")
def echo_stack(redis_server: RedisServer, logdir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One API and one worker serving the test models; ECHO_LOG records executed rows."""
    log = tmp_path_factory.mktemp("echo") / "executed.log"
    stack = Stack(redis_server.url, TEST_MODELS, logdir,
                  extra_env={"ECHO_LOG": str(log), "CONVEYOR_MODELS": "echo,slow"})
    stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    yield stack
    stack.stop()
