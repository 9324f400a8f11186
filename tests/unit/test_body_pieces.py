"""A request body gathered as the parser hands it over (api/http_direct.py ``BodyPieces``):
large pieces kept as they are, small ones gathered into one buffer."""

from __future__ import annotations

from api.http_direct import KEEP_BYTES, BodyPieces


def test_a_body_in_one_large_piece_is_that_piece_not_a_copy() -> None:
    piece = bytes(range(256)) * (KEEP_BYTES // 256 + 1)
    body = BodyPieces()
    body += piece
    assert len(body) == len(piece)
    assert bytes(body) is piece


def test_pieces_large_and_small_make_the_body_in_their_order() -> None:
    large = [bytes([n]) * KEEP_BYTES for n in (1, 2)]
    sent = [b"a", large[0], b"bc", b"d", large[1], b"e"]
    body = BodyPieces()
    for piece in sent:
        body += piece
    assert len(body) == sum(map(len, sent))
    assert bytes(body) == b"".join(sent)


def test_a_body_trickling_in_small_pieces_is_gathered_into_one_buffer() -> None:
    body = BodyPieces()
    for n in range(1000):
        body += bytes([n % 256])
    assert len(body._pieces) == 1  # one buffer, not a thousand objects
    assert bytes(body) == bytes(n % 256 for n in range(1000))


def test_an_empty_body_is_empty() -> None:
    body = BodyPieces()
    assert len(body) == 0 and bytes(body) == b""
