"""The API in this process: ``create_app`` over the in-memory dispatcher, served by
Starlette's TestClient (lifespan included, gRPC left out), the test models' folder as
the repository. No redis-server, uvicorn or Celery process starts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.bytes_endpoint import BytesEndpoint
from api.main import create_app
from batching.envelope import Reply, Request, Tensor
from batching.keys import Keys
from batching.settings import Settings
from tests.bytes_endpoints import running_endpoint
from tests.unit.memory_dispatch import MemoryDispatcher

TEST_MODELS = Path(__file__).resolve().parent.parent / "models"


def echo(request: Request) -> Reply:
    """tests/models/echo in-process: ``y = 2x`` and the batch's rows (each request alone),
    every output whatever the request asked for, 3 ms in the queue."""
    x = request.inputs[0].array()
    outputs = [Tensor.from_array("y", x * 2),
               Tensor.from_array("batch_rows", np.full((x.shape[0], 1), x.shape[0], np.int64))]
    return Reply(request.id, outputs, batch_rows=x.shape[0], queue_ms=3.0)


def unit_settings(**overrides: object) -> Settings:
    """Settings of an API serving echo and slow from tests/models, whatever the environment
    holds for the fields named here."""
    fields: dict[str, object] = {"model_repository": TEST_MODELS, "models": "echo,slow",
                                 "key_prefix": "unit", "api_keys_file": None,
                                 "redis_url": "redis://127.0.0.1:1/0", **overrides}
    return Settings(**fields)  # type: ignore[arg-type]


def serve(settings: Settings, dispatcher: MemoryDispatcher) -> TestClient:
    """A TestClient of the whole application; enter it to run the lifespan."""
    return TestClient(create_app(settings, dispatcher, grpc=False))


@pytest.fixture
def settings() -> Settings:
    return unit_settings()


@pytest.fixture
def dispatcher(settings: Settings) -> MemoryDispatcher:
    return MemoryDispatcher(Keys(settings.key_prefix), echo)


@pytest.fixture
def client(settings: Settings, dispatcher: MemoryDispatcher) -> Iterator[TestClient]:
    """The API with a ready worker for echo (none for slow)."""
    dispatcher.beat("echo")
    with serve(settings, dispatcher) as client:
        yield client


@pytest.fixture
def endpoint() -> Iterator[BytesEndpoint]:
    """A bytes endpoint on loopback, closed after the test."""
    with running_endpoint() as started:
        yield started
