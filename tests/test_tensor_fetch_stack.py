"""Large inputs fetched by the inference process from its API process's bytes endpoint, the
path between hosts, forced on one (``CONVEYOR_TENSOR_TRANSPORT=fetch``), against a real
redis-server, API processes and a Celery worker: every answer is its own input's, Redis
reads a small part of the bytes sent, the endpoint refuses a forged token, and the requests
of an API process killed before its inputs were fetched are answered with an error, never
run on other bytes, while another API process's requests run; the entries of a worker
killed with their inputs in hand are fetched again by the next."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import cast

import httpx
import numpy as np
import pytest
import redis

from batching.envelope import FIELD, Reply, Request
from batching.errors import Unavailable
from batching.keys import Keys
from batching.tensor_transport import FetchClient, is_remote
from tests.conftest import MakeStack, Stack
from tests.image_stack import across_a_killed_worker, random_images, slowed
from tests.procs import wait_for
from tests.test_tensor_arena_stack import MODEL, _repository

pytestmark = pytest.mark.integration

FETCH = {"CONVEYOR_TENSOR_TRANSPORT": "fetch", "CONVEYOR_TENSOR_ARENA_MB": "0"}
"""The path between hosts; without it (no arena either) every input would go through Redis."""


def _body(image: np.ndarray) -> tuple[bytes, dict[str, str]]:
    header = json.dumps({"inputs": [{"name": "image", "datatype": "UINT8",
                                     "shape": list(image.shape),
                                     "parameters": {"binary_data_size": image.nbytes}}]}).encode()
    return header + image.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def _total(url: str, image: np.ndarray) -> int:
    body, headers = _body(image)
    response = httpx.post(f"{url}/v2/models/summer/infer", content=body, headers=headers,
                          timeout=60)
    assert response.status_code == 200, response.text
    return int(response.json()["outputs"][0]["data"][0])


def _entries(r: redis.Redis, stack: Stack) -> list[Request]:
    """Every request waiting in the stack's model streams."""
    found: list[Request] = []
    for key in r.scan_iter(match=f"{stack.prefix}:*:q:*", _type="stream"):
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], r.xrange(key))
        found += [Request.decode(fields[FIELD]) for _, fields in entries]
    return found


def _replies(r: redis.Redis, stack: Stack) -> list[Reply]:
    return [Reply.decode(item) for key in r.scan_iter(match=f"{stack.prefix}:reply:*")
            for item in cast(list[bytes], r.lrange(key, 0, -1))]


def test_inputs_fetched_from_the_api_process_answer_their_own_requests(
        make_stack: MakeStack, tmp_path: Path) -> None:
    stack = make_stack(_repository(tmp_path / "repo"), **FETCH)
    url = stack.add_api()
    stack.add_worker()
    stack.wait_ready()
    r = stack.redis()
    images = random_images(48, seed=5)
    before = int(r.info("stats")["total_net_input_bytes"])
    with ThreadPoolExecutor(8) as pool:  # several in flight: batches of several fetched at once
        totals = list(pool.map(lambda image: _total(url, image), images))
    read = int(r.info("stats")["total_net_input_bytes"]) - before
    assert totals == [int(image.sum()) for image in images]
    sent = sum(image.nbytes for image in images)
    assert read < sent / 4, f"Redis read {read:,} bytes of {sent:,} sent"


def _in_flight(pool: ThreadPoolExecutor, url: str,
               images: list[np.ndarray]) -> list[Future[int]]:
    return [pool.submit(_total, url, image) for image in images]


def test_a_dead_api_process_s_requests_are_answered_with_an_error_never_run(
        make_stack: MakeStack, tmp_path: Path) -> None:
    stack = make_stack(_repository(tmp_path / "repo"), **FETCH)
    doomed, kept = stack.add_api(), stack.add_api()
    worker = stack.add_worker()
    stack.wait_ready()
    r = stack.redis()
    warm = random_images(1, seed=1)[0]
    assert _total(doomed, warm) == _total(kept, warm) == int(warm.sum())
    lost, fine = random_images(4, seed=2), random_images(4, seed=3)
    os.killpg(worker.pid, signal.SIGSTOP)  # the worker reads nothing until SIGCONT
    pool = ThreadPoolExecutor(8)
    try:
        _in_flight(pool, doomed, lost)
        wait_for(lambda: len(_entries(r, stack)) == len(lost), 30, "the doomed requests queued")
        waiting = _entries(r, stack)
        refs = [t.ref for e in waiting for t in e.inputs if t.ref is not None]
        assert len(refs) == len(lost) and all(is_remote(ref) for ref in refs)
        client = FetchClient(5.0)
        got = client.fetch([refs[0], [*refs[0][:4], bytes(16)]])
        assert isinstance(got[0], memoryview)
        assert bytes(got[0]) in {image.tobytes() for image in lost}
        assert "token" in str(got[1])
        client.close()
        stack.apis[0][0].kill_group()  # SIGKILL: its inputs can no longer be had
        answers = _in_flight(pool, kept, fine)
        wait_for(lambda: len(_entries(r, stack)) == len(lost) + len(fine), 30,
                 "the other API's requests queued")
    finally:
        os.killpg(worker.pid, signal.SIGCONT)
    assert [a.result(timeout=60) for a in answers] == [int(image.sum()) for image in fine]
    pool.shutdown(wait=False, cancel_futures=True)
    wait_for(lambda: sum(not reply.ok for reply in _replies(r, stack)) == len(lost), 30,
             "the dead API process's requests answered")
    errors = [reply for reply in _replies(r, stack) if not reply.ok]
    assert {reply.id for reply in errors} == {e.id for e in waiting}
    for reply in errors:
        assert reply.error_code == Unavailable.code, reply.error
        assert "could not be fetched" in reply.error


def test_a_killed_worker_s_entries_are_fetched_again_by_the_next(
        make_stack: MakeStack, tmp_path: Path) -> None:
    stack = make_stack(_repository(tmp_path / "repo", slowed(MODEL)),
                       CONVEYOR_HEARTBEAT_STALE_S="2", **FETCH)
    url = stack.add_api()
    given = random_images(3, seed=7)
    totals, _ = across_a_killed_worker(stack, lambda image: _total(url, image), given)
    assert totals == [int(image.sum()) for image in given]
    r = stack.redis()
    stats = cast(dict[bytes, bytes], r.hgetall(Keys(stack.prefix).stats("summer")))
    assert int(stats.get(b"reclaimed_count", 0)) >= 1
