"""One registered system shared memory region, as this process holds it: an open file
descriptor on a POSIX shared memory object in ``/dev/shm``.

The object is opened once, when the region is registered (or first used by this process),
and read and written with ``pread``/``pwrite`` at the region's offset: never mapped. A
client that shrinks or removes its object while a request uses it gets an error for
that request; a mapping would take the whole process down with SIGBUS. The descriptor
is closed when the region is unregistered and no request holds it any more
(:meth:`Region.retire`, :meth:`Region.hold`), so a descriptor number is never reused
under a running read, and a request in flight still writes its outputs.

Keys are checked before anything is opened: a key names one object directly in
``/dev/shm`` (leading slashes are dropped, as ``shm_open`` does), never a path, a
symbolic link or anything but a regular file, and never an object of a reserved prefix.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from api.shm_params import U64_MAX, ShmRef
from batching.errors import InvalidInput, RegionNotFound

SHM_DIR = Path("/dev/shm")
NAME_MAX = 255
"""Longest object name (bytes), and longest region name (characters)."""
RESERVED_PREFIXES = ("triton_python_backend_shm_region_", "sem.")
"""Objects no client may register: Triton's Python backend regions (Triton refuses them
too) and POSIX named semaphores."""
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def host_scope() -> str:
    """What identifies the ``/dev/shm`` this process sees: the machine's boot and the
    device of the mount, so processes that see the same objects share their registrations
    and no others do (another host, another container with its own ``/dev/shm``)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        device = os.stat(SHM_DIR).st_dev
    except OSError:
        device = 0
    return f"{boot}:{device:x}"


def shown(text: str) -> str:
    """A client's string as error messages quote it: cut past NAME_MAX characters."""
    return text if len(text) <= NAME_MAX else text[:NAME_MAX] + "..."


def check_region_name(name: str) -> None:
    if not name:
        raise InvalidInput("'region name' is necessary to register system shared memory region")
    if len(name) > NAME_MAX or not name.isprintable():
        raise InvalidInput(f"invalid shared memory region name '{shown(name)}': at most "
                           f"{NAME_MAX} printable characters")


def object_name(region: str, key: str) -> str:
    """The object in ``/dev/shm`` that ``key`` names; Triton's messages where it has them."""
    bare = key.lstrip("/")
    invalid = InvalidInput(f"cannot register shared memory region '{region}' - invalid shm "
                           f"key '{shown(key)}'")
    if not bare:
        raise invalid
    for prefix in RESERVED_PREFIXES:
        if bare.startswith(prefix):
            raise InvalidInput(f"cannot register shared memory region '{region}' with key "
                               f"'{shown(key)}' as the key contains the reserved prefix "
                               f"'{prefix}'")
    if ("/" in bare or "\x00" in bare or bare in (".", "..")
            or len(bare.encode("utf-8", "surrogateescape")) > NAME_MAX):
        raise invalid
    return bare


@dataclass(frozen=True, slots=True)
class Registration:
    """What a region's registration records (its value in Redis, less the name)."""

    key: str
    offset: int
    byte_size: int
    token: str
    """Unique to one registration: a name registered again is a different region."""


class Region:
    def __init__(self, name: str, registration: Registration) -> None:
        """Open and check the object; raises :class:`InvalidInput` with Triton's messages."""
        self.name = name
        self.registration = registration
        key, offset, byte_size = registration.key, registration.offset, registration.byte_size
        path = SHM_DIR / object_name(name, key)
        self.writable = True
        try:
            try:
                self._fd = os.open(path, os.O_RDWR | _OPEN)
            except PermissionError:
                self.writable = False
                self._fd = os.open(path, os.O_RDONLY | _OPEN)
        except OSError:
            raise InvalidInput(f"Unable to open shared memory region: '{shown(key)}'") from None
        try:
            info = os.fstat(self._fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidInput(f"Invalid shared memory region: '{shown(key)}'")
            if byte_size == 0 or offset + byte_size > info.st_size:
                raise InvalidInput(f"failed to register shared memory region '{name}': "
                                   "invalid args")
        except BaseException:
            os.close(self._fd)
            raise
        self._lock = threading.Lock()
        self._users = 0
        self._retired = False
        self._closed = False

    @property
    def byte_size(self) -> int:
        return self.registration.byte_size

    def check(self, ref: ShmRef) -> None:
        """``ref`` must lie inside the region (Triton's checks and messages)."""
        if ref.offset >= self.byte_size:
            raise InvalidInput(f"Invalid offset for shared memory region: '{self.name}'")
        if ref.byte_size > U64_MAX - ref.offset:
            raise InvalidInput(f"Integer overflow detected: byte_size ({ref.byte_size}) + "
                               f"offset ({ref.offset}) exceeds maximum value ({U64_MAX}) "
                               f"for region '{self.name}'")
        if ref.offset + ref.byte_size > self.byte_size:
            raise InvalidInput(f"Invalid offset + byte size for shared memory region: "
                               f"'{self.name}'")

    def read(self, ref: ShmRef) -> bytes:
        """The ``ref.byte_size`` bytes at ``ref.offset`` (checked with :meth:`check`)."""
        with self._using():
            data = os.pread(self._fd, ref.byte_size, self.registration.offset + ref.offset)
        if len(data) != ref.byte_size:
            raise InvalidInput(f"shared memory region '{self.name}' holds fewer bytes than "
                               "it was registered with: its object shrank")
        return data

    def write(self, ref: ShmRef, data: bytes | memoryview) -> None:
        """``data`` (at most ``ref.byte_size`` bytes) at ``ref.offset``."""
        if not self.writable:
            raise InvalidInput(f"shared memory region '{self.name}' is read-only to the "
                               "server: outputs cannot be written to it")
        start = self.registration.offset + ref.offset
        with self._using():
            if os.fstat(self._fd).st_size < start + len(data):
                raise InvalidInput(f"shared memory region '{self.name}' holds fewer bytes "
                                   "than it was registered with: its object shrank")
            os.pwrite(self._fd, data, start)

    def retire(self) -> None:
        """Unregistered: close now, or when the last request holding it lets it go."""
        with self._lock:
            if self._retired:
                return
            self._retired = True
            close = self._closed = not self._users
        if close:
            os.close(self._fd)

    def hold(self) -> None:
        """Keep the region open until :meth:`release`, even if it is retired meanwhile;
        raises :class:`RegionNotFound` once it is closed."""
        with self._lock:
            if self._closed:
                raise RegionNotFound(f"Unable to find shared memory region: '{self.name}'")
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            close = self._closed = self._retired and not self._users
        if close:
            os.close(self._fd)

    @contextmanager
    def _using(self) -> Iterator[None]:
        self.hold()
        try:
            yield
        finally:
            self.release()
