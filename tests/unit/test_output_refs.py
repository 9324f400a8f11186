"""Large outputs uploaded by the inference process to the bytes endpoint of the API process
that holds their request (batching/output_refs.py, api/output_upload.py,
api/output_offers.py, workers/output_push.py), in-process over loopback: the reply then
names them and the API resolves them to the very bytes; small outputs stay in the reply;
an upload refused (no place, another token, past its deadline, over its bound, a second
time) or that cannot reach its API process leaves the outputs in the reply; a reply that
names bytes the API does not hold is an internal error, never other bytes."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
import pytest

from api.bytes_endpoint import BytesEndpoint
from api.output_offers import OutputOffers, expected_bytes, offers_from
from api.output_upload import Uploads
from batching.config import ModelConfig, TensorSpec
from batching.envelope import Reply, Request, Tensor
from batching.errors import ConveyorError
from batching.former import Entry
from batching.output_refs import (
    HEAD,
    ITEM,
    OFFER,
    STATUS,
    UPLOAD_MAGIC,
    Offer,
    UploadRefusal,
    is_output_ref,
)
from batching.settings import Settings
from batching.tensor_arena import HOST_FILE
from batching.tensor_transport import FetchClient, client_context
from tests.bytes_endpoints import tls_endpoint
from workers.output_push import OutputPush

MIN = 8192
WIDTH = 16384
"""FP32 elements of one output row: 64 KiB, above ``MIN``."""
MODEL = ModelConfig(name="masks", backend="python", max_batch_size=8,
                    inputs=(TensorSpec("x", "FP32", (-1, 4)),),
                    outputs=(TensorSpec("mask", "FP32", (-1, WIDTH)),
                             TensorSpec("score", "FP32", (-1, 1))))


def _later() -> int:
    return int(time.time() * 1000) + 60_000


def _request(rid: str, deadline_ms: int | None = None) -> Request:
    return Request(rid, "reply", deadline_ms or _later(), 0.0, 1,
                   [Tensor("x", "FP32", (1, 4), bytes(16))])


def _answered(offers: OutputOffers, count: int, seed: int = 0
              ) -> list[tuple[Entry, Reply, Offer | None]]:
    """``count`` requests offered a place, each answered with a large and a small output."""
    rng = np.random.default_rng(seed)
    made = []
    for i in range(count):
        request = _request(f"r{i}")
        offer = offers.offer("masks", request, 1)
        reply = Reply(request.id, [
            Tensor.from_array("mask", rng.random((1, WIDTH), dtype=np.float32)),
            Tensor.from_array("score", np.full((1, 1), i, np.float32))])
        made.append((Entry("s", f"{i}-0", request, 0.0), reply, offer))
    return made


def _offers(endpoint: BytesEndpoint, **kwargs: int) -> OutputOffers:
    return OutputOffers(Uploads(kwargs.get("min_bytes", MIN)), endpoint, {"masks": MODEL},
                        lambda model: True, kwargs.get("open_bound", 1 << 20))


def _through_redis(reply: Reply) -> Reply:
    return Reply.decode(reply.encode())


def test_large_outputs_come_back_by_reference_to_the_very_bytes(
        endpoint: BytesEndpoint) -> None:
    offers = _offers(endpoint)
    answered = _answered(offers, 5)
    sent = [[bytes(t.raw) for t in reply.outputs] for _, reply, _ in answered]
    push = OutputPush(5.0)
    push.push([(entry, reply) for entry, reply, _ in answered])
    push.close()
    for (_, reply, offer), raw in zip(answered, sent, strict=True):
        mask, score = reply.outputs
        assert is_output_ref(mask.ref) and mask.raw == b""
        assert score.ref is None and score.raw == raw[1]  # small: stays in the reply
        assert len(reply.encode()) < 200
        got = _through_redis(reply)
        assert offer is not None
        offers.resolve(offer, got)
        assert [bytes(t.raw) for t in got.outputs] == raw
        assert all(t.ref is None for t in got.outputs)
    assert len(offers.uploads) == 0  # each taken with its reply


def test_an_upload_is_one_round_trip_pair_beside_fetches_on_one_connection(
        endpoint: BytesEndpoint) -> None:
    offers = _offers(endpoint)
    ref = endpoint.put(b"x" * 50_000, _later())
    client = FetchClient(5.0)
    push = OutputPush(5.0)
    for _ in range(2):
        answered = _answered(offers, 2)
        push.push([(entry, reply) for entry, reply, _ in answered])
        assert all(is_output_ref(reply.outputs[0].ref) for _, reply, _ in answered)
        got = client.fetch([ref])
        assert isinstance(got[0], memoryview) and bytes(got[0]) == b"x" * 50_000
    push.close()
    client.close()


def test_small_outputs_and_models_with_small_outputs_get_no_upload(
        endpoint: BytesEndpoint) -> None:
    small = ModelConfig(name="small", backend="python", max_batch_size=8, inputs=MODEL.inputs,
                        outputs=(TensorSpec("y", "FP32", (-1, 4)),))
    offers = OutputOffers(Uploads(MIN), endpoint, {"masks": MODEL, "small": small},
                          lambda model: True, 1 << 20)
    request = _request("a")
    assert offers.offer("small", request, 8) is None and OFFER not in request.params
    assert offers.offer("unknown", request, 1) is None
    offer = offers.offer("masks", request, 1)
    assert offer is not None and offer.bound == WIDTH * 4 + 4
    reply = Reply("a", [Tensor.from_array("mask", np.zeros((1, 100), np.float32))])
    OutputPush(5.0).push([(Entry("s", "1-0", request, 0.0), reply)])
    assert reply.outputs[0].ref is None and len(reply.outputs[0].raw) == 400


def test_expected_bytes_follow_the_declared_outputs_and_rows() -> None:
    assert expected_bytes(MODEL, [], 3) == 3 * (WIDTH * 4 + 4)
    assert expected_bytes(MODEL, ["score"], 3) == 12
    ragged = ModelConfig(name="r", backend="python", max_batch_size=8, inputs=MODEL.inputs,
                         outputs=(TensorSpec("y", "FP32", (-1, -1)),))
    assert expected_bytes(ragged, [], 2) is None
    words = ModelConfig(name="w", backend="python", max_batch_size=8, inputs=MODEL.inputs,
                        outputs=(TensorSpec("y", "BYTES", (-1, 1)),))
    assert expected_bytes(words, [], 2) is None
    whole = ModelConfig(name="u", backend="python", max_batch_size=0, inputs=(TensorSpec("x", "FP32", (4,)),),
                        outputs=(TensorSpec("y", "UINT8", (3, 5)),))
    assert expected_bytes(whole, [], 1) == 15


def test_an_open_bound_is_the_largest_request(endpoint: BytesEndpoint) -> None:
    ragged = ModelConfig(name="masks", backend="python", max_batch_size=8, inputs=MODEL.inputs,
                         outputs=(TensorSpec("y", "FP32", (-1, -1)),))
    offers = OutputOffers(Uploads(MIN), endpoint, {"masks": ragged}, lambda m: True, 12345)
    offer = offers.offer("masks", _request("a"), 1)
    assert offer is not None and offer.bound == 12345


def test_settings_choose_who_is_offered(endpoint: BytesEndpoint, tmp_path: Path) -> None:
    models = {"masks": MODEL}
    assert offers_from(Settings(tensor_transport="redis"), endpoint, models,
                       lambda m, t: False) is None
    assert offers_from(Settings(), None, models, lambda m, t: False) is None
    fetch = offers_from(Settings(tensor_transport="fetch"), endpoint, models,
                        lambda m, t: True)
    assert fetch is not None and fetch.offer("masks", _request("a"), 1) is not None
    (tmp_path / HOST_FILE).write_text("host-a")
    sharing = offers_from(Settings(), endpoint, models, lambda m, t: True, tmp_path)
    apart = offers_from(Settings(), endpoint, models, lambda m, t: False, tmp_path)
    assert sharing is not None and sharing.offer("masks", _request("a"), 1) is None
    assert apart is not None and apart.offer("masks", _request("a"), 1) is not None


def _raw_upload(endpoint: BytesEndpoint, offer: Offer, token: bytes, length: int
                ) -> tuple[int, socket.socket]:
    """An upload's first step by hand: the endpoint's answer, and the connection."""
    host, port = endpoint.where.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(HEAD.pack(UPLOAD_MAGIC, 1) + ITEM.pack(offer.id, token, length))
    answer = b""
    while len(answer) < len(UPLOAD_MAGIC) + STATUS.size:
        answer += sock.recv(64)
    assert answer[:4] == UPLOAD_MAGIC
    return STATUS.unpack_from(answer, 4)[0], sock


def test_the_endpoint_refuses_uploads_without_their_reference_or_past_their_bound(
        endpoint: BytesEndpoint) -> None:
    offers = _offers(endpoint)
    uploads = offers.uploads
    offer = offers.offer("masks", _request("a"), 1)
    late = offers.offer("masks", _request("b", int(time.time() * 1000) - 1), 1)
    assert offer is not None and late is not None
    cases = [
        (Offer(offer.where, 999_999, 10, offer.expiry_ms, offer.token, MIN), offer.token, 10,
         UploadRefusal.GONE),
        (offer, bytes(16), 10, UploadRefusal.TOKEN),
        (late, late.token, 10, UploadRefusal.EXPIRED),
        (offer, offer.token, offer.bound + 1, UploadRefusal.TOO_LARGE),
    ]
    for which, token, length, refusal in cases:
        status, sock = _raw_upload(endpoint, which, token, length)
        sock.close()
        assert status == -refusal, refusal
    status, sock = _raw_upload(endpoint, offer, offer.token, 10)
    assert status == 0
    sock.sendall(b"0123456789")
    stored = sock.recv(HEAD.size, socket.MSG_WAITALL)
    sock.close()
    assert HEAD.unpack(stored) == (UPLOAD_MAGIC, 1)
    again, sock = _raw_upload(endpoint, offer, offer.token, 10)
    sock.close()
    assert again == -UploadRefusal.USED  # a reference is single-use
    assert uploads.take(offer.id) == [b"0123456789"]


def test_a_refused_or_unreachable_upload_leaves_the_outputs_in_the_reply(
        endpoint: BytesEndpoint) -> None:
    offers = _offers(endpoint)
    answered = _answered(offers, 3)
    first = answered[0][2]
    assert first is not None
    offers.free(first)  # that request is over for the API: its upload is refused
    push = OutputPush(5.0)
    push.push([(entry, reply) for entry, reply, _ in answered])
    assert answered[0][1].outputs[0].ref is None
    assert len(answered[0][1].outputs[0].raw) == WIDTH * 4
    assert all(is_output_ref(reply.outputs[0].ref) for _, reply, _ in answered[1:])
    endpoint.close()  # the API process gone
    again = _answered(offers, 2, seed=1)
    raw = [bytes(reply.outputs[0].raw) for _, reply, _ in again]
    push.push([(entry, reply) for entry, reply, _ in again])
    push.close()
    assert [bytes(reply.outputs[0].raw) for _, reply, _ in again] == raw
    assert all(reply.outputs[0].ref is None for _, reply, _ in again)


def test_a_reply_naming_bytes_the_api_does_not_hold_is_an_internal_error(
        endpoint: BytesEndpoint) -> None:
    offers = _offers(endpoint)
    answered = _answered(offers, 2)
    push = OutputPush(5.0)
    push.push([(entry, reply) for entry, reply, _ in answered])
    push.close()
    (_, one, offer_one), (_, two, offer_two) = answered
    assert offer_one is not None and offer_two is not None
    with pytest.raises(ConveyorError) as caught:
        offers.resolve(offer_one, _through_redis(two))  # another request's upload
    assert caught.value.code == "internal" and "does not hold" in caught.value.message
    offers.free(offer_two)
    with pytest.raises(ConveyorError):
        offers.resolve(offer_two, _through_redis(two))  # given up meanwhile
    assert len(one.outputs[0].raw) == 0


def test_an_endpoint_that_speaks_tls_takes_uploads_over_tls(tmp_path: Path) -> None:
    with tls_endpoint(tmp_path) as (endpoint, cert):
        offers = _offers(endpoint)
        answered = _answered(offers, 2)
        raw = [bytes(reply.outputs[0].raw) for _, reply, _ in answered]
        push = OutputPush(5.0, client_context(cert))
        push.push([(entry, reply) for entry, reply, _ in answered])
        push.close()
        for (_, reply, offer), sent in zip(answered, raw, strict=True):
            assert offer is not None and is_output_ref(reply.outputs[0].ref)
            got = _through_redis(reply)
            offers.resolve(offer, got)
            assert bytes(got.outputs[0].raw) == sent


def test_an_api_process_that_takes_connections_but_stalls_holds_one_answer_only(
        endpoint: BytesEndpoint) -> None:
    offers = _offers(endpoint)
    stalled = socket.create_server(("127.0.0.1", 0))  # accepts (the backlog), never answers
    try:
        where = f"tcp://127.0.0.1:{stalled.getsockname()[1]}"
        push = OutputPush(0.3)
        for round_ in range(2):
            answered = _answered(offers, 1, seed=round_)
            entry, reply, _ = answered[0]
            entry.request.params[OFFER][0] = where
            raw = bytes(reply.outputs[0].raw)
            push.push([(entry, reply)])
            assert reply.outputs[0].ref is None and bytes(reply.outputs[0].raw) == raw
        push.close()
        stalled.settimeout(5)
        stalled.accept()[0].close()  # the first batch's connection
        stalled.setblocking(False)
        with pytest.raises(BlockingIOError):  # the second batch did not wait on it again
            stalled.accept()
    finally:
        stalled.close()


def test_a_reply_naming_an_upload_for_a_request_offered_none_is_an_internal_error(
        endpoint: BytesEndpoint) -> None:
    offers = _offers(endpoint)
    reply = Reply("a", [Tensor("mask", "FP32", (1, WIDTH), b"", [1, 0, WIDTH * 4]),
                        Tensor.from_array("score", np.zeros((1, 1), np.float32))])
    with pytest.raises(ConveyorError) as caught:
        offers.resolve(None, _through_redis(reply))
    assert caught.value.code == "internal" and "'mask'" in caught.value.message
    plain = Reply("b", [Tensor.from_array("score", np.ones((1, 1), np.float32))])
    offers.resolve(None, plain)
    assert plain.outputs[0].raw == np.ones((1, 1), np.float32).tobytes()
