"""Behaviour Triton's clients and QA tests rely on, beyond error texts: binary and JSON
outputs (L0_http), a full queue (503 / UNAVAILABLE), HTTP framing, the server's name,
and statistics that count a reply as soon as it arrives."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Stack
from tests.procs import RedisServer, wait_for
from tests.triton_stack import ONES, SERVER_NAME, grpc_url, http_url, triton_stack

DOUBLED = "[2,4,6,8,10,12,14,16,18,20,22,24,26,28,30,32]"
ZEROS = "[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]"
COUNTS = list(range(1, 17))


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, logdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from triton_stack(redis_server, logdir, tmp_path_factory.mktemp("triton-behaviour"))


def body(**extra: Any) -> dict[str, Any]:
    return {**extra, "inputs": [
        {"name": name, "datatype": "INT32", "shape": [1, 16], "data": COUNTS}
        for name in ("INPUT0", "INPUT1")]}


@pytest.mark.parametrize("extra,sum_as_json,difference_as_json", [
    ({}, True, True),
    ({"outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}},
                  {"name": "OUTPUT1", "parameters": {"binary_data": False}}]}, False, True),
    ({"outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}},
                  {"name": "OUTPUT1"}]}, False, True),
    ({"parameters": {"binary_data_output": True}}, False, False),
    ({"parameters": {"binary_data_output": True},
      "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}},
                  {"name": "OUTPUT1"}]}, True, True),
])
def test_binary_and_json_outputs_as_l0_http_checks_them(stack: Stack, extra: dict[str, Any],
                                                       sum_as_json: bool,
                                                       difference_as_json: bool) -> None:
    """A listed output is binary only by its own binary_data; binary_data_output covers
    the outputs of a request that lists none."""
    response = httpx.post(f"{stack.url}/v2/models/simple/infer", content=json.dumps(body(**extra)))
    assert response.status_code == 200, response.text
    text = response.content.decode("latin-1")
    assert (DOUBLED in text, ZEROS in text) == (sum_as_json, difference_as_json)


def test_a_full_queue_is_503_with_retry_after_and_unavailable_over_grpc(stack: Stack) -> None:
    """L0_http's descriptive status code test: a model whose queue holds one request."""
    url = f"{stack.url}/v2/models/simple_queue/infer"
    first = threading.Thread(target=httpx.post, args=(url,),
                             kwargs={"content": json.dumps(body()), "timeout": 30})
    first.start()
    with stack.redis() as redis:  # the first request holds the queue's one row
        wait_for(lambda: int(redis.get(f"{stack.prefix}:{{simple_queue}}:rows") or 0) == 1,
                 30, "the first request to be admitted")
    try:
        refused = httpx.post(url, content=json.dumps(body()))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"].startswith("Exceeds maximum queue size")
        client = grpcclient.InferenceServerClient(grpc_url(stack))
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            item = grpcclient.InferInput(name, [1, 16], "INT32")
            item.set_data_from_numpy(ONES)
            inputs.append(item)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("simple_queue", inputs)
        assert caught.value.status() == "StatusCode.UNAVAILABLE"
        client.close()
    finally:
        first.join()


def exchange(stack: Stack, *requests: bytes) -> list[bytes]:
    """Send ``requests`` on one connection, one after the other; each whole response."""
    host, port = http_url(stack).split(":")
    answers = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for request in requests:
            sock.sendall(request)
            answers.append(read_response(sock))
    return answers


def read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        rest += sock.recv(65536)
    return head + b"\r\n\r\n" + rest


def test_chunked_with_content_length_is_read_as_chunked(stack: Stack) -> None:
    """RFC 9112 section 6.3: Transfer-Encoding wins; the connection closes afterwards.
    What Triton's L0_http test sends (requests adds Content-Length to a chunked body)."""
    payload = json.dumps(body()).encode()
    chunked = b"%X\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
    request = (b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\n"
               b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s"
               % (len(chunked), chunked))
    [answer] = exchange(stack, request)
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer
    assert b"connection: close" in head.lower()
    assert DOUBLED.encode() in content
    plain = (b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
             % (len(payload), payload))
    kept = exchange(stack, plain, plain)  # an ordinary request keeps its connection
    assert all(a.startswith(b"HTTP/1.1 200") for a in kept)


def test_the_parsers_own_errors_have_an_error_body(stack: Stack) -> None:
    [answer] = exchange(stack, b"POST /v2 HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert set(json.loads(content)) == {"error"}


def test_server_name_is_the_configured_one(stack: Stack) -> None:
    with httpclient.InferenceServerClient(http_url(stack)) as client:
        assert client.get_server_metadata()["name"] == SERVER_NAME
    client = grpcclient.InferenceServerClient(grpc_url(stack))
    assert client.get_server_metadata().name == SERVER_NAME
    client.close()


def successes(stats: Any) -> int:
    if isinstance(stats, dict):
        return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])
    return int(stats.model_stats[0].inference_stats.success.count)


def test_statistics_count_a_reply_as_soon_as_it_arrives(stack: Stack) -> None:
    """Triton's statistics are exact when the reply arrives; so are conveyor's."""
    http = httpclient.InferenceServerClient(http_url(stack))
    grpc = grpcclient.InferenceServerClient(grpc_url(stack))
    for client, module in ((http, httpclient), (grpc, grpcclient)):
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            item = module.InferInput(name, [1, 16], "INT32")
            item.set_data_from_numpy(ONES)
            inputs.append(item)
        before = successes(client.get_inference_statistics("simple"))
        for done in range(1, 11):
            client.infer("simple", inputs)
            assert successes(client.get_inference_statistics("simple")) == before + done
    http.close()
    grpc.close()

    async def with_aio() -> None:
        aio_http = aiohttpclient.InferenceServerClient(http_url(stack))
        aio_grpc = aiogrpcclient.InferenceServerClient(grpc_url(stack))
        try:
            for client, module in ((aio_http, aiohttpclient), (aio_grpc, aiogrpcclient)):
                inputs = []
                for name in ("INPUT0", "INPUT1"):
                    item = module.InferInput(name, [1, 16], "INT32")
                    item.set_data_from_numpy(ONES)
                    inputs.append(item)
                before = successes(await client.get_inference_statistics("simple"))
                for done in range(1, 6):
                    await client.infer("simple", inputs)
                    assert successes(await client.get_inference_statistics("simple")) == \
                        before + done
        finally:
            await aio_http.close()
            await aio_grpc.close()

    asyncio.run(with_aio())
