"""HTTP/2 wire pieces for the native gRPC listener: frame headers, frames, header blocks.

Request header blocks are decoded by ``hpack`` (RFC 7541). A block that changes no table
state (indexed fields and literals not indexed: what a client sends again and again once
its headers sit in the table) is kept with its decoded list and reused while the table
stays as it was.
Response headers are written as literals without indexing (no encoder table to keep
in step with the peer's): a response's head and its trailers are a few constant bytes
and the status.
"""

from __future__ import annotations

import struct
from typing import Final

import hpack

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)

END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY_FLAG: Final = 0x20

# Settings identifiers (RFC 9113 section 6.5.2)
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = range(1, 7)

# Error codes (RFC 9113 section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, \
    STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = range(10)
ENHANCE_YOUR_CALM: Final = 0xB

DEFAULT_WINDOW: Final = 65_535
DEFAULT_FRAME_SIZE: Final = 16_384
MAX_WINDOW: Final = 2**31 - 1

_HEAD = struct.Struct(">I")  # 24-bit length and type, read as one word
_CACHED_BLOCKS = 256
_CACHED_BLOCK_BYTES = 1024
"""At most 256 blocks of 1 KiB each are kept per connection."""


class ProtocolError(Exception):
    """The peer broke HTTP/2: the connection ends with GOAWAY and this error code."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


class Pending:
    """Bytes that do not yet make a whole unit (a frame, a message), kept as chunks and
    joined once enough have come: a large unit costs one copy, not one per chunk."""

    __slots__ = ("chunks", "need", "size")

    def __init__(self, need: int) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.need = need

    def add(self, data: bytes) -> bytes | None:
        """What is held with ``data`` after it, once that is at least ``need`` bytes."""
        if not self.chunks and len(data) >= self.need:
            return data
        self.chunks.append(data)
        self.size += len(data)
        if self.size < self.need:
            return None
        whole = b"".join(self.chunks)
        self.chunks, self.size = [], 0
        return whole

    def keep(self, rest: bytes, need: int) -> None:
        """Hold ``rest`` until ``need`` bytes (``rest`` included) have come."""
        self.chunks = [rest] if rest else []
        self.size = len(rest)
        self.need = need


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (_HEAD.pack(len(payload) << 8 | kind) + bytes((flags,))
            + stream_id.to_bytes(4, "big") + payload)


def settings_frame(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in values.items()))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, last_stream_id.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)


def _length(n: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 section 5.1) in ``prefix_bits`` of its first byte."""
    limit = (1 << prefix_bits) - 1
    if n < limit:
        return bytes((first | n,))
    out = bytearray((first | limit,))
    n -= limit
    while n >= 128:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """One header as a literal field without indexing, new name, no Huffman coding."""
    return b"\x00" + _length(len(name), 7) + name + _length(len(value), 7) + value


def literal_indexed_name(index: int, value: bytes) -> bytes:
    """A literal without indexing whose name is static table entry ``index``."""
    return _length(index, 4) + _length(len(value), 7) + value


def parse_settings(payload: bytes) -> dict[int, int]:
    if len(payload) % 6:
        raise ProtocolError("a SETTINGS frame's length is not a multiple of 6", FRAME_SIZE_ERROR)
    return {k: v for k, v in struct.iter_unpack(">HI", payload)}


def _skip_integer(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """The HPACK integer at ``block[i]`` and the index after it."""
    limit = (1 << prefix_bits) - 1
    value = block[i] & limit
    i += 1
    if value == limit:
        shift = 0
        while True:
            byte = block[i]
            value += (byte & 0x7F) << shift
            shift += 7
            i += 1
            if not byte & 0x80:
                break
    return value, i


def _keeps_table(block: bytes) -> bool:
    """Whether decoding ``block`` leaves the header table as it was: only indexed fields
    and literals without indexing or never indexed, no literal with incremental indexing,
    no table size update. Such a block decodes to the same list while the table stays."""
    i, n = 0, len(block)
    try:
        while i < n:
            first = block[i]
            if first & 0x80:
                _, i = _skip_integer(block, i, 7)
            elif first & 0x60:  # 01: incremental indexing; 001: table size update
                return False
            else:
                name, i = _skip_integer(block, i, 4)
                if name == 0:
                    length, i = _skip_integer(block, i, 7)
                    i += length
                length, i = _skip_integer(block, i, 7)
                i += length
    except IndexError:
        return False
    return i == n


class HeaderDecoder:
    """One connection's request header decoder (the peer's encoder table lives here)."""

    def __init__(self, max_header_list_size: int) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self._cache: dict[bytes, list[tuple[str, str]]] = {}

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        cached = self._cache.get(block)
        if cached is not None:
            return cached
        try:
            headers = [(str(k), str(v)) for k, v in self._decoder.decode(block)]
        except hpack.OversizedHeaderListError as exc:
            raise ProtocolError(f"request headers too large: {exc}", ENHANCE_YOUR_CALM) from exc
        except (hpack.HPACKError, UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"undecodable header block: {exc}", COMPRESSION_ERROR) from exc
        if len(block) <= _CACHED_BLOCK_BYTES and _keeps_table(block):
            if len(self._cache) >= _CACHED_BLOCKS:
                self._cache.clear()
            self._cache[block] = headers
        else:  # the table may have changed: what cached blocks referred to may have moved
            self._cache.clear()
        return headers
