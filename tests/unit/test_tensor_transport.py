"""Large inputs fetched from their API process's bytes endpoint (api/bytes_endpoint.py,
batching/tensor_transport.py), in-process over loopback: the bytes come back whole, each
endpoint answers one fetch in one round trip, and a reference that was freed, expired or
carries another token gets no bytes, as does one whose endpoint is gone or silent."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from api import bytes_endpoint, input_arena
from api.bytes_endpoint import BytesEndpoint, advertised_host, endpoint_from
from api.input_arena import InputArena
from batching import tensor_transport
from batching.config import ModelConfig, TensorSpec
from batching.envelope import Request, Tensor
from batching.settings import Settings
from batching.tensor_arena import ArenaReader, TensorGone
from batching.tensor_transport import (
    FetchClient,
    Ref,
    client_context,
    encode_request,
    is_remote,
)
from tests.bytes_endpoints import tls_endpoint
from tests.test_listeners import make_cert

LATER_MS = 60_000


def _later() -> int:
    return int(time.time() * 1000) + LATER_MS


@pytest.fixture
def client() -> Iterator[FetchClient]:
    made = FetchClient(5.0)
    yield made
    made.close()


def _blobs(count: int, size: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(count)]


def _counting(endpoint: BytesEndpoint) -> list[int]:
    """The size of each fetch ``endpoint`` answers from now on."""
    fetches: list[int] = []
    serve = endpoint.serve

    def counted(items: list[tuple[int, bytes]]) -> list[bytes | memoryview]:
        fetches.append(len(items))
        return serve(items)

    endpoint.serve = counted  # type: ignore[method-assign]
    return fetches


def test_a_batch_of_inputs_comes_back_whole_in_one_fetch_per_endpoint(
        endpoint: BytesEndpoint, client: FetchClient) -> None:
    other = BytesEndpoint("127.0.0.1")
    other.start()
    try:
        blobs = _blobs(40, 150_528)
        refs = [(endpoint if i % 2 else other).put(b, _later()) for i, b in enumerate(blobs)]
        fetches = _counting(endpoint), _counting(other)
        got = client.fetch(refs)
        assert [bytes(g) for g in got if isinstance(g, memoryview)] == blobs
        assert fetches == ([20], [20])
    finally:
        other.close()


def test_freed_expired_and_wrong_token_references_get_no_bytes(endpoint: BytesEndpoint,
                                                              client: FetchClient) -> None:
    fine, freed, expired, forged = (endpoint.put(b, _later()) for b in _blobs(4, 1000))
    endpoint.free(freed)
    expired = endpoint.put(b"x" * 1000, int(time.time() * 1000) - 1)
    forged = [*forged[:4], bytes(16)]
    got = client.fetch([fine, freed, expired, forged])
    assert isinstance(got[0], memoryview) and len(got[0]) == 1000
    reasons = [str(g) for g in got[1:]]
    assert "no longer holds" in reasons[0]
    assert "expired" in reasons[1]
    assert "token" in reasons[2]
    assert isinstance(client.fetch([fine])[0], memoryview)  # the connection is still good


def test_a_malformed_reference_is_refused_without_a_fetch(endpoint: BytesEndpoint,
                                                         client: FetchClient) -> None:
    fetches = _counting(endpoint)
    ref = endpoint.put(b"y" * 10, _later())
    bad: list[Ref] = [[ref[0], ref[1], 10, ref[3], b"short"], ["http://x:1", 1, 10, 0, bytes(16)]]
    got = client.fetch(bad)
    assert all(isinstance(g, TensorGone) and "malformed" in str(g) for g in got)
    assert fetches == []


def test_an_endpoint_that_is_gone_or_silent_fails_its_inputs_in_time(
        endpoint: BytesEndpoint) -> None:
    alive = endpoint.put(b"z" * 100, _later())
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        dead = [f"tcp://127.0.0.1:{gone.getsockname()[1]}", 1, 100, _later(), bytes(16)]
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts (the kernel's backlog) and never answers
        mute = [f"tcp://127.0.0.1:{silent.getsockname()[1]}", 1, 100, _later(), bytes(16)]
        started = time.monotonic()
        quick = FetchClient(0.5)
        got = quick.fetch([dead, alive, mute])
        took = time.monotonic() - started
        quick.close()
    assert isinstance(got[1], memoryview) and bytes(got[1]) == b"z" * 100
    assert isinstance(got[0], TensorGone) and "could not be fetched" in str(got[0])
    assert isinstance(got[2], TensorGone) and "timed out" in str(got[2])
    assert took < 5.0


def test_an_endpoint_that_speaks_tls_is_fetched_from_over_tls(tmp_path: Path) -> None:
    with tls_endpoint(tmp_path) as (endpoint, cert):
        blobs = _blobs(3, 200_000, seed=1)
        refs = [endpoint.put(b, _later()) for b in blobs]
        assert endpoint.where.startswith("tls://127.0.0.1:")
        trusting, untrusting = FetchClient(5.0, client_context(cert)), FetchClient(5.0)
        got = trusting.fetch(refs)
        assert [bytes(g) for g in got if isinstance(g, memoryview)] == blobs
        untrusted = untrusting.fetch(refs[:1])
        trusting.close()
        assert isinstance(untrusted[0], TensorGone) and "CERTIFICATE" in str(untrusted[0]).upper()


def test_a_fixed_port_taken_moves_to_the_next(endpoint: BytesEndpoint) -> None:
    taken = int(endpoint.where.rsplit(":", 1)[1])
    second = BytesEndpoint("127.0.0.1", taken)
    second.start()
    try:
        assert int(second.where.rsplit(":", 1)[1]) > taken
    finally:
        second.close()


def test_the_advertised_address_is_the_bind_address_or_the_way_to_redis() -> None:
    assert advertised_host("10.1.2.3", "redis://127.0.0.1:6379/0") == "10.1.2.3"
    assert advertised_host("0.0.0.0", "redis://127.0.0.1:6379/0") == "127.0.0.1"
    assert advertised_host("0.0.0.0", "redis+sentinel://127.0.0.1:26379,h2:1/m/0") == "127.0.0.1"


def _config(timeout_ms: int = 5000) -> ModelConfig:
    config = ModelConfig("far", "python", 8, inputs=(TensorSpec("x", "UINT8", (-1, -1)),),
                         outputs=(TensorSpec("y", "UINT8", (-1, -1)),))
    return replace(config, queue=replace(config.queue, default_timeout_ms=timeout_ms))


def _inputs(*sizes: int) -> list[Tensor]:
    return [Tensor(f"t{i}", "UINT8", (1, n), b"\x02" * n) for i, n in enumerate(sizes)]


def test_the_api_places_inputs_in_its_endpoint_for_a_model_on_other_hosts(
        tmp_path: Path, endpoint: BytesEndpoint, client: FetchClient) -> None:
    placer = InputArena(64 * 1024, 1000, lambda model, token: model == "near", tmp_path,
                        endpoint=endpoint, models={"far": _config(), "near": _config()})
    inputs = _inputs(2000, 10)
    refs = placer.place("far", inputs)
    assert refs is not None and len(refs) == 1 and is_remote(refs[0])
    assert inputs[0].raw == b"" and len(inputs[1].raw) == 10
    expiry = refs[0][3]
    assert time.time() * 1000 < expiry <= time.time() * 1000 + 5000
    decoded = Request.decode(Request("r", "q", 0, 0.0, 1, inputs).encode())  # as it travels
    assert decoded.inputs[0].ref == refs[0]
    assert bytes(client.fetch(refs)[0]) == b"\x02" * 2000  # type: ignore[arg-type]
    near = placer.place("near", _inputs(2000))
    assert near is not None and not is_remote(near[0])  # the arena, on this host
    assert bytes(ArenaReader(tmp_path).view(near[0])) == b"\x02" * 2000
    placer.free(refs + near)
    assert isinstance(client.fetch(refs)[0], TensorGone)
    assert placer.place("unloaded", _inputs(2000)) is None
    placer.close()


def test_fetch_forces_the_endpoint_and_redis_keeps_inputs_inline(
        tmp_path: Path, endpoint: BytesEndpoint) -> None:
    models = {"near": _config()}
    forced = InputArena(64 * 1024, 1000, lambda model, token: True, tmp_path,
                        endpoint=endpoint, models=models, transport="fetch")
    refs = forced.place("near", _inputs(2000))
    assert refs is not None and is_remote(refs[0])
    inline = InputArena(64 * 1024, 1000, lambda model, token: False, tmp_path,
                        endpoint=endpoint, models=models, transport="redis")
    assert inline.place("near", _inputs(2000)) is None
    auto_off = InputArena(0, 1000, lambda model, token: True, tmp_path, endpoint=endpoint,
                          models=models)
    assert auto_off.place("near", _inputs(2000)) is None  # on this host, no arena: Redis


def test_an_endpoint_that_cannot_be_reached_is_not_tried_again_at_once() -> None:
    with socket.socket() as full, socket.socket() as first:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        first.connect(full.getsockname())  # the backlog is full: the next SYN goes unanswered
        ref = [f"tcp://127.0.0.1:{full.getsockname()[1]}", 1, 100, _later(), bytes(16)]
        client = FetchClient(0.3)
        started = time.monotonic()
        got = client.fetch([ref])
        waited = time.monotonic() - started
        started = time.monotonic()
        again = client.fetch([ref, ref])
        at_once = time.monotonic() - started
        client.close()
    assert waited >= 0.25
    assert at_once < 0.1
    assert all(isinstance(g, TensorGone) and "timed out" in str(g) for g in [*got, *again])


def test_the_settings_endpoint_binds_the_api_host_and_speaks_tls_when_the_api_does(
        tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "api")
    assert endpoint_from(Settings(tensor_transport="redis")) is None
    plain = endpoint_from(Settings(host="127.0.0.1"))
    tls = endpoint_from(Settings(host="127.0.0.1", tls_cert_file=cert, tls_key_file=key,
                                 tensor_fetch_host="localhost"))
    assert plain is not None and tls is not None
    plain.start()
    tls.start()
    try:
        assert plain.where.startswith("tcp://127.0.0.1:")
        assert tls.where.startswith("tls://localhost:")
        client = FetchClient(5.0, client_context(cert))
        got = client.fetch([plain.put(b"p" * 50, _later()), tls.put(b"t" * 50, _later())])
        client.close()
        assert [bytes(g) for g in got if isinstance(g, memoryview)] == [b"p" * 50, b"t" * 50]
    finally:
        plain.close()
        tls.close()


def test_a_restarted_endpoint_is_asked_again_on_a_new_connection(client: FetchClient) -> None:
    first = BytesEndpoint("127.0.0.1")
    first.start()
    port = int(first.where.rsplit(":", 1)[1])
    assert isinstance(client.fetch([first.put(b"a" * 10, _later())])[0], memoryview)
    first.close()  # the kept connection is closed under the client
    again = BytesEndpoint("127.0.0.1", port)
    again.start()
    try:
        assert again.where == first.where
        got = client.fetch([again.put(b"b" * 10, _later())])
        assert isinstance(got[0], memoryview) and bytes(got[0]) == b"b" * 10
    finally:
        again.close()


def test_connections_beyond_the_kept_number_are_closed_least_recent_first(
        monkeypatch: pytest.MonkeyPatch, client: FetchClient) -> None:
    monkeypatch.setattr(tensor_transport, "KEEP_LINKS", 2)
    endpoints = [BytesEndpoint("127.0.0.1") for _ in range(3)]
    for endpoint in endpoints:
        endpoint.start()
    try:
        refs = [e.put(b"c", _later()) for e in endpoints]
        for ref in (refs[0], refs[1], refs[0], refs[2]):  # the second is the least recent
            assert isinstance(client.fetch([ref])[0], memoryview)
        assert list(client._links) == [endpoints[0].where, endpoints[2].where]
    finally:
        for endpoint in endpoints:
            endpoint.close()


def test_inputs_the_full_arena_cannot_take_go_to_the_endpoint(
        tmp_path: Path, endpoint: BytesEndpoint) -> None:
    placer = InputArena(8 * 1024, 1000, lambda model, token: True, tmp_path,
                        endpoint=endpoint, models={"near": _config()})
    refs = placer.place("near", _inputs(5000, 5000))
    assert refs is not None and [is_remote(r) for r in refs] == [False, True]
    placer.free(refs)
    placer.close()


def test_every_tensor_gets_a_token_of_its_own(endpoint: BytesEndpoint) -> None:
    tokens = [endpoint.put(b"t", _later())[4] for _ in range(600)]  # past two draws of entropy
    assert len(set(tokens)) == len(tokens) and {len(t) for t in tokens} == {16}


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """The endpoint closed ``sock`` within ``seconds``."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def test_a_stalled_fetch_is_cut_and_an_idle_connection_kept(
        monkeypatch: pytest.MonkeyPatch, endpoint: BytesEndpoint) -> None:
    monkeypatch.setattr(bytes_endpoint, "STALL_S", 0.2)
    ref = endpoint.put(b"i" * 10, _later())
    host, port = endpoint.where.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as stalled, \
            socket.create_connection((host, int(port))) as idle:
        idle.sendall(encode_request([(ref[1], ref[4])]))
        idle.settimeout(10.0)
        assert idle.recv(64).endswith(b"i" * 10)
        stalled.sendall(encode_request([(ref[1], ref[4])])[:5])  # and nothing more
        assert _closed_within(stalled, 10.0)
        time.sleep(0.5)  # idle past the stall limit between fetches, a reference shown
        idle.sendall(encode_request([(ref[1], ref[4])]))
        assert idle.recv(64).endswith(b"i" * 10)


def test_a_connection_without_a_valid_reference_is_not_kept(
        monkeypatch: pytest.MonkeyPatch, endpoint: BytesEndpoint) -> None:
    """A peer holding no reference cannot keep connections: an idle one is closed at the
    stall limit, one whose fetch names none once answered (the table stays free for the
    inference processes)."""
    monkeypatch.setattr(bytes_endpoint, "STALL_S", 0.2)
    ref = endpoint.put(b"i" * 10, _later())
    host, port = endpoint.where.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as silent, \
            socket.create_connection((host, int(port))) as forger:
        forger.sendall(encode_request([(ref[1], b"\0" * len(ref[4]))]))
        forger.settimeout(10.0)
        answer = forger.recv(64)
        assert answer and b"i" not in answer  # refused, then let go
        assert _closed_within(forger, 10.0)
        assert _closed_within(silent, 10.0)


def test_connections_beyond_the_most_are_closed_at_once(
        monkeypatch: pytest.MonkeyPatch, endpoint: BytesEndpoint) -> None:
    """A full table closes a new connection when every one open has shown a valid
    reference; else the new one displaces the oldest that has shown none."""
    monkeypatch.setattr(bytes_endpoint, "MAX_CONNECTIONS", 2)
    ref = endpoint.put(b"i" * 10, _later())
    host, port = endpoint.where.removeprefix("tcp://").rsplit(":", 1)
    held = [socket.create_connection((host, int(port))) for _ in range(2)]
    try:
        for sock in held:
            sock.sendall(encode_request([(ref[1], ref[4])]))
            sock.settimeout(10.0)
            assert sock.recv(64).endswith(b"i" * 10)
        with socket.create_connection((host, int(port))) as third:
            assert _closed_within(third, 10.0)
        assert not any(_closed_within(sock, 0.2) for sock in held)
        held.pop().close()
        deadline = time.monotonic() + 10.0
        while True:  # until its thread has let go of its place
            squatter = socket.create_connection((host, int(port)))
            held.append(squatter)
            if not _closed_within(squatter, 0.2) or time.monotonic() > deadline:
                break
        with socket.create_connection((host, int(port))) as worker:
            assert _closed_within(squatter, 10.0)  # displaced: it showed no reference
            worker.sendall(encode_request([(ref[1], ref[4])]))
            worker.settimeout(10.0)
            assert worker.recv(64).endswith(b"i" * 10)
    finally:
        for sock in held:
            sock.close()


def test_an_arena_that_cannot_be_made_leaves_the_endpoint(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: BytesEndpoint) -> None:
    def no_room(size: int, directory: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(input_arena, "Arena", no_room)
    placer = InputArena(64 * 1024, 1000, lambda model, token: True, tmp_path,
                        endpoint=endpoint, models={"near": _config()})
    refs = placer.place("near", _inputs(2000))
    assert refs is not None and is_remote(refs[0])
