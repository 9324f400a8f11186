"""Large inputs kept out of Redis: through shared memory where the model's inference
processes share this host's memory (batching/tensor_arena.py), else fetched by them from
this API process's bytes endpoint (batching/tensor_transport.py, api/bytes_endpoint.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

from api.bytes_endpoint import BytesEndpoint
from batching.config import ModelConfig
from batching.envelope import Tensor
from batching.tensor_arena import SHM_DIR, Arena, Ref, host_token
from batching.tensor_transport import is_remote

log = logging.getLogger(__name__)

Transport = Literal["auto", "fetch", "redis"]
"""``CONVEYOR_TENSOR_TRANSPORT``: the arena or the endpoint as the model's processes
allow (``auto``), the endpoint always (``fetch``), or Redis always (``redis``)."""


class InputArena:
    """Puts a request's inputs of ``min_bytes`` or more in this API process's arena (made
    on first use, ``size`` bytes) while ``shares(model, token)`` says every inference
    process of the model reads this host's token, or else (or when the arena is full) in
    ``endpoint``, whose references expire with the model's longest timeout (``models``);
    anything else goes through Redis."""

    def __init__(self, size: int, min_bytes: int, shares: Callable[[str, str], bool],
                 directory: Path = SHM_DIR, *, endpoint: BytesEndpoint | None = None,
                 models: Mapping[str, ModelConfig] | None = None,
                 transport: Transport = "auto") -> None:
        self._size = size if transport == "auto" else 0
        self._min_bytes = min_bytes
        self._shares = shares
        self._directory = directory
        self._endpoint = endpoint if transport != "redis" else None
        self._models = models or {}
        self._shared_off = transport == "auto" and size <= 0
        """The arena is turned off: a model sharing this host's memory gets Redis."""
        self._arena: Arena | None = None
        self._token: str | None = None
        self._looked = False
        """The host token was looked up (and the arena made, if it is on)."""
        self._off = self._size <= 0 and self._endpoint is None

    def place(self, model: str, inputs: list[Tensor]) -> list[Ref] | None:
        """Move the large ``inputs`` into the arena or the endpoint (their ``ref`` set,
        ``raw`` emptied); the references to :meth:`free` once the request is over, or
        None."""
        if self._off or not any(len(t.raw) >= self._min_bytes for t in inputs):
            return None
        stores = self._stores(model)
        refs: list[Ref] = []
        for tensor in inputs:
            if len(tensor.raw) >= self._min_bytes:
                ref = next((r for put in stores if (r := put(tensor.raw)) is not None), None)
                if ref is None:  # the arena full, no endpoint: through Redis
                    continue
                tensor.ref, tensor.raw = ref, b""
                refs.append(ref)
        return refs or None

    def free(self, refs: list[Ref]) -> None:
        for ref in refs:
            if is_remote(ref):
                if self._endpoint is not None:
                    self._endpoint.free(ref)
            elif self._arena is not None:
                self._arena.free(ref)

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _stores(self, model: str) -> list[Callable[[bytes | memoryview], Ref | None]]:
        """Where the large inputs of a request to ``model`` may go now, in turn: the arena
        (where the model's processes share this host's memory), then the endpoint (when
        they do not, or the arena is full); none: Redis."""
        if not self._looked:
            self._open()
        token = self._token
        sharing = token is not None and self._shares(model, token)
        if sharing and self._shared_off:
            return []
        stores: list[Callable[[bytes | memoryview], Ref | None]] = []
        if sharing and self._arena is not None:
            stores.append(self._arena.put)
        endpoint = self._endpoint
        config = self._models.get(model)  # None: unloaded meanwhile
        if endpoint is not None and endpoint.started and config is not None:
            expiry = int(time.time() * 1000) + config.queue.default_timeout_ms  # its latest
            stores.append(lambda data: endpoint.put(data, expiry))
        return stores

    def _open(self) -> None:
        self._looked = True
        self._token = host_token(self._directory)
        try:
            if self._token is not None and self._size > 0:
                self._arena = Arena(self._size, self._directory)
                log.info("large inputs pass through shared memory where the model's "
                         "inference processes share this host's (%s, %d MiB)",
                         self._arena.path, self._size >> 20)
        except OSError as exc:
            log.warning("large inputs skip shared memory: no tensor arena in %s: %s",
                        self._directory, exc)
        self._off = self._arena is None and self._endpoint is None
