"""Large input tensors that skip Redis: a shared-memory arena per API process, read in
place by the inference processes of the same host.

Through Redis a 150 KB image costs about 400 µs of Redis's one core (the bytes go in,
through the admission script, and out again), which bounds a model at about 2,400
requests a second however many GPUs serve it. When an API process and every inference
process of a model see the same ``/dev/shm``, the API process writes a large tensor into
its arena and the stream entry carries only a reference: ``[arena, offset, length,
sequence]``.

- **Who sees the same memory.** :func:`host_token` is a random token kept in
  ``/dev/shm/conveyor-host``, created by the first process that asks, and the process's
  user id (an arena is readable by its owner only). Processes that read the same token
  share the memory; a container with its own ``/dev/shm``, or another host, reads
  another. Inference processes put theirs in their heartbeat, and an API process uses its
  arena for a model only while every heartbeat of the model carries its own token.
- **Lifetime.** The API process frees a tensor's space once the request is over for it
  (answered, timed out, its client gone): an inference process only reads while the
  request can still be answered. Each tensor is preceded by its sequence number, which
  :meth:`Arena.free` wipes; a reader that finds another number answers the request
  with an error (its API process had given it up) instead of running stale bytes.
- **A ring.** Space is taken in order and given back in order: a tensor freed early
  waits for the older ones. What a full arena cannot take is fetched from the API process
  instead (batching/tensor_transport.py).
- **A dead API process** leaves its arena behind; each arena file is ``flock``-ed by its
  owner for life, and the next arena created on the host removes those nobody holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
import struct
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
HOST_FILE = "conveyor-host"
PREFIX = "conveyor-arena-"
_HEADER = struct.Struct("<8sQ")
_MAGIC = b"cvtensor"
_ALIGN = 64
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_YOUNG_S = 10.0
"""An arena file younger than this is never swept: its owner may not have locked it yet."""

Ref = list[Any]
"""``[arena name, offset, length, sequence]``, as it travels in a request envelope."""


class TensorGone(Exception):
    """A reference this process cannot read: another host's arena, or space given back."""


def host_token(directory: Path = SHM_DIR) -> str | None:
    """The token of the shared memory this process sees, with its user id: an arena
    (mode 0600) can be read by processes of the same user only. None: no such directory."""
    token = _memory_token(directory)
    return None if token is None else f"{token}:{os.getuid()}"


def _memory_token(directory: Path) -> str | None:
    path = directory / HOST_FILE
    with contextlib.suppress(FileNotFoundError, OSError):
        token = path.read_text().strip()
        if token:
            return token
    try:  # written aside, then linked into place: a reader never sees half a token
        scratch = directory / f".{HOST_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        scratch.write_text(secrets.token_hex(16))
        try:
            os.link(scratch, path)
        except FileExistsError:
            pass
        finally:
            scratch.unlink()
        return path.read_text().strip() or None
    except OSError as exc:
        log.info("no shared tensor memory: %s: %s", directory, exc)
        return None


@dataclass(slots=True)
class _Span:
    offset: int
    end: int
    seq: int
    freed: bool = False


class Arena:
    """One API process's arena: ``put`` copies a tensor in, ``free`` gives it back."""

    def __init__(self, size: int, directory: Path = SHM_DIR) -> None:
        sweep(directory)
        self.name = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path = directory / f"{PREFIX}{self.name}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held for life: sweep() leaves the arena alone
            # Reserved now, not on first touch: a /dev/shm too small (a container's 64 MB
            # default) fails here rather than with SIGBUS on a write.
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        self._fd = fd
        self.size = size
        self._head = 0
        self._spans: deque[_Span] = deque()
        self._by_seq: dict[int, _Span] = {}
        self._seqs = itertools.count(1)

    def put(self, data: bytes | memoryview) -> Ref | None:
        """Copy ``data`` in; its reference, or None when the arena has no room."""
        length = len(data)
        need = -(-(_HEADER.size + length) // _ALIGN) * _ALIGN
        offset = self._room(need)
        if offset is None:
            return None
        seq = next(self._seqs)
        start = offset + _HEADER.size
        self._map[start:start + length] = data
        _HEADER.pack_into(self._map, offset, _MAGIC, seq)
        span = _Span(offset, offset + need, seq)
        self._spans.append(span)
        self._by_seq[seq] = span
        self._head = span.end
        return [self.name, offset, length, seq]

    def free(self, ref: Ref) -> None:
        span = self._by_seq.pop(ref[3], None)
        if span is None:
            return
        span.freed = True
        _HEADER.pack_into(self._map, span.offset, _MAGIC, 0)  # a late reader finds it gone
        while self._spans and self._spans[0].freed:
            self._spans.popleft()
        if not self._spans:
            self._head = 0

    def _room(self, need: int) -> int | None:
        if not self._spans:
            return 0 if need <= self.size else None
        tail, head = self._spans[0].offset, self._head
        if head > tail:  # in use: [tail, head); free: [head, size) and [0, tail)
            if head + need <= self.size:
                return head
            return 0 if need <= tail else None
        return head if head + need <= tail else None  # wrapped: free is [head, tail)

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self.path.unlink(missing_ok=True)


def sweep(directory: Path = SHM_DIR) -> int:
    """Remove the arenas whose owner is gone (nobody holds their lock); how many."""
    removed = 0
    now = time.time()
    for path in directory.glob(f"{PREFIX}*"):
        try:
            if now - path.stat().st_mtime < _YOUNG_S:
                continue
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner holds it
        else:
            path.unlink(missing_ok=True)
            removed += 1
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d tensor arena(s) of API processes that are gone", removed)
    return removed


class ArenaReader:
    """An inference process's view of the arenas of its host, mapped once each."""

    def __init__(self, directory: Path = SHM_DIR, keep: int = 64,
                 check_every_s: float = 10.0) -> None:
        self._directory = directory
        self._keep = keep
        self._check_every_s = check_every_s
        self._maps: OrderedDict[str, tuple[mmap.mmap, int]] = OrderedDict()
        self._checked = time.monotonic()

    def view(self, ref: Ref) -> memoryview:
        """The tensor's bytes in place; :class:`TensorGone` if they cannot be read."""
        try:
            name, offset, length, seq = ref
            offset, length, seq = int(offset), int(length), int(seq)
        except (TypeError, ValueError):
            raise TensorGone(f"malformed shared tensor reference {ref!r}") from None
        mapped = self._map(str(name))
        start = offset + _HEADER.size
        if offset < 0 or length < 0 or start + length > len(mapped):
            raise TensorGone(f"shared tensor reference {ref!r} is out of its arena's bounds")
        magic, found = _HEADER.unpack_from(mapped, offset)
        if magic != _MAGIC or found != seq:
            raise TensorGone("the API process that admitted the request no longer holds its "
                             "input (it gave the request up)")
        return memoryview(mapped)[start:start + length]

    def _map(self, name: str) -> mmap.mmap:
        self._forget_removed()
        held = self._maps.get(name)
        if held is not None:
            self._maps.move_to_end(name)
            return held[0]
        if not _NAME.fullmatch(name):
            raise TensorGone(f"bad shared tensor arena name {name!r}")
        path = self._directory / f"{PREFIX}{name}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            raise TensorGone(
                f"the request's input is in shared memory this inference process cannot "
                f"see ({path}): its API process runs on another host or in another "
                f"container") from None
        try:
            mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        self._maps[name] = (mapped, inode)
        while len(self._maps) > self._keep:
            self._maps.popitem(last=False)  # unmapped once no batch holds a view of it
        return mapped

    def _forget_removed(self) -> None:
        """Drop the mappings of arenas that were removed (their API process ended), so
        that their memory goes back once no batch still reads from them."""
        now = time.monotonic()
        if now - self._checked < self._check_every_s:
            return
        self._checked = now
        for name, (_, inode) in list(self._maps.items()):
            try:
                current = (self._directory / f"{PREFIX}{name}").stat().st_ino
            except OSError:
                current = -1
            if current != inode:
                del self._maps[name]
