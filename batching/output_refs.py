"""Large outputs sent back by reference: the inference process uploads a reply's large
output bytes to the bytes endpoint of the API process that holds the request
(api/bytes_endpoint.py, api/output_upload.py) and the Redis reply carries only where they
are; the API resolves them in its own memory when it builds the response.

Push, not pull: the API owns the bytes once they are sent, so an inference process that
dies after answering loses nothing, and the API needs no connection to the worker hosts.

The request offers the upload in its envelope (``params[OFFER]``):
``[where, id, bound, expiry_ms, token, min_bytes]``: ``where`` the endpoint
(``tcp://host:port`` or ``tls://``), ``token`` 16 random bytes made for this request's
outputs alone, ``bound`` the most bytes it takes (the request's own expected output size),
``expiry_ms`` the request's deadline, ``min_bytes`` the smallest output worth uploading.
An output uploaded travels in the reply as a tensor with no bytes and the reference
``[id, index, length]``: the ``index``-th tensor of the upload to ``id``.

The protocol, on a kept-alive connection to the bytes endpoint (TLS when the API speaks
it), in two steps so that the endpoint never reads bytes it has not accepted:

- offer: ``CVU1``, a ``u32`` count *n*, then *n* times (``u64`` id, 16-byte token,
  ``u64`` length): one item per tensor, a request's tensors under its one id;
- answer: ``CVU1``, *n* ``i64``: 0 accepted, or a negative :class:`UploadRefusal`
  (every item of one id gets the same);
- the bytes of the accepted items, in order (none accepted: the exchange ends here);
- answer: ``CVU1``, a ``u32``: the count of tensors stored.

Everything little-endian.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

from batching import tensor_transport as fetch

UPLOAD_MAGIC = b"CVU1"
HEAD = fetch.COUNT
"""An upload's head: ``UPLOAD_MAGIC`` and its item count, as a fetch's."""
ITEM = struct.Struct("<Q16sQ")
STATUS = fetch.LENGTH
"""Each item's answer, a fetch's length field: 0, or a refusal negated."""
TOKEN_BYTES = fetch.TOKEN_BYTES
MAX_ITEMS = fetch.MAX_ITEMS
"""Most tensors in one upload, as in a fetch; a larger one is a protocol error."""
OFFER = "out"
"""``params`` key of a request whose large outputs may be uploaded (the offer)."""


class UploadRefusal(enum.IntEnum):
    """Why the endpoint takes no bytes for an upload (sent negated)."""

    GONE = 1
    """Unknown id: the request is over for its API process, or that process restarted."""
    TOKEN = 2
    """The token is not the one made for this request's outputs."""
    EXPIRED = 3
    """Past the request's deadline."""
    TOO_LARGE = 4
    """More bytes than the request's outputs can hold."""
    USED = 5
    """An upload to this reference was accepted before: a reference is single-use."""


@dataclass(frozen=True, slots=True)
class Offer:
    where: str
    id: int
    bound: int
    expiry_ms: int
    token: bytes
    min_bytes: int

    def pack(self) -> list[Any]:
        return [self.where, self.id, self.bound, self.expiry_ms, self.token, self.min_bytes]


def parse_offer(raw: Any) -> Offer | None:
    """The offer a request carries, checked; None if it carries none or a malformed one."""
    if raw is None:
        return None
    try:
        where, rid, bound, expiry, token, min_bytes = raw
        offer = Offer(str(where), int(rid), int(bound), int(expiry), bytes(token),
                      int(min_bytes))
    except (TypeError, ValueError):
        return None
    if (offer.id < 0 or offer.bound < 0 or offer.min_bytes < 1
            or len(offer.token) != TOKEN_BYTES
            or not offer.where.startswith(("tcp://", "tls://"))):
        return None
    return offer


def output_ref(rid: int, index: int, length: int) -> list[Any]:
    """A reply tensor's reference to the ``index``-th tensor of the upload to ``rid``."""
    return [rid, index, length]


def is_output_ref(ref: list[Any] | None) -> bool:
    """``ref`` is an uploaded output's (not an input's, which have 4 or 5 fields)."""
    return ref is not None and len(ref) == 3
