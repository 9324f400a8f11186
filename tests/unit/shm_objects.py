"""POSIX shared memory objects for the in-process shared memory tests: plain files in
/dev/shm, which is what ``shm_open`` makes on Linux (no resource tracker involved)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

SHM_DIR = Path("/dev/shm")


class Objects:
    """Creates objects under unique names and removes them at the end of the test."""

    def __init__(self) -> None:
        self.made: list[Path] = []

    def make(self, size: int, data: bytes = b"") -> str:
        """A new object of ``size`` bytes starting with ``data``; its key (``/name``)."""
        path = SHM_DIR / f"conveyor-test-{uuid.uuid4().hex[:12]}"
        path.write_bytes(data.ljust(size, b"\0"))
        self.made.append(path)
        return f"/{path.name}"

    def path(self, key: str) -> Path:
        return SHM_DIR / key.lstrip("/")

    def remove(self) -> None:
        for path in self.made:
            path.unlink(missing_ok=True)


def made_objects() -> Iterator[Objects]:
    """The body of each test module's ``objects`` fixture."""
    made = Objects()
    yield made
    made.remove()
