"""Large inputs through shared memory instead of Redis, where the model's inference
processes share this host's memory (batching/tensor_arena.py has the arena and why)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from batching.envelope import Tensor
from batching.tensor_arena import SHM_DIR, Arena, Ref, host_token

log = logging.getLogger(__name__)


class InputArena:
    """Puts a request's inputs of ``min_bytes`` or more in this API process's arena (made
    on first use, ``size`` bytes) while ``shares(model, token)`` says every inference
    process of the model reads this host's token; anything else goes through Redis."""

    def __init__(self, size: int, min_bytes: int, shares: Callable[[str, str], bool],
                 directory: Path = SHM_DIR) -> None:
        self._size = size
        self._min_bytes = min_bytes
        self._shares = shares
        self._directory = directory
        self._arena: Arena | None = None
        self._token: str | None = None
        self._off = size <= 0

    def place(self, model: str, inputs: list[Tensor]) -> list[Ref] | None:
        """Move the large ``inputs`` into the arena (their ``ref`` set, ``raw`` emptied);
        the references to :meth:`free` once the request is over, or None."""
        if self._off or not any(len(t.raw) >= self._min_bytes for t in inputs):
            return None
        arena = self._arena or self._open()
        if arena is None or self._token is None or not self._shares(model, self._token):
            return None
        refs: list[Ref] = []
        for tensor in inputs:
            if len(tensor.raw) >= self._min_bytes:
                ref = arena.put(tensor.raw)
                if ref is None:  # full: this one and the rest through Redis
                    break
                tensor.ref, tensor.raw = ref, b""
                refs.append(ref)
        return refs or None

    def free(self, refs: list[Ref]) -> None:
        if self._arena is not None:
            for ref in refs:
                self._arena.free(ref)

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _open(self) -> Arena | None:
        self._token = host_token(self._directory)
        try:
            if self._token is not None:
                self._arena = Arena(self._size, self._directory)
                log.info("large inputs pass through shared memory where the model's "
                         "inference processes share this host's (%s, %d MiB)",
                         self._arena.path, self._size >> 20)
        except OSError as exc:
            log.warning("large inputs go through Redis: no tensor arena in %s: %s",
                        self._directory, exc)
        self._off = self._arena is None
        return self._arena
