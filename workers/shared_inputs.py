"""Inputs an API process kept out of Redis: read in place from its shared tensor arena on
this host (batching/tensor_arena.py), or fetched from its bytes endpoint on another
(batching/tensor_transport.py), when their entries arrive."""

from __future__ import annotations

from collections.abc import Callable

from batching.envelope import Tensor
from batching.former import Entry
from batching.settings import Settings
from batching.tensor_arena import ArenaReader, TensorGone
from batching.tensor_transport import FetchClient, client_context, is_remote


def settings_client() -> FetchClient:
    """A fetch client as ``CONVEYOR_TENSOR_FETCH_*`` configure it."""
    settings = Settings()
    return FetchClient(settings.tensor_fetch_timeout_s,
                       client_context(settings.tensor_fetch_ca_file))


class SharedInputs:
    """Resolves the references of arriving entries: arena references into views of the
    arena, endpoint references into the bytes fetched, those of all the entries of one
    call in one round trip per API process."""

    def __init__(self, reader: ArenaReader | None = None,
                 fetch: FetchClient | Callable[[], FetchClient] = settings_client) -> None:
        self._reader = reader
        """Made on the first reference: a model that never gets one maps nothing."""
        self._fetch = fetch
        """The fetch client, or what makes it on the first endpoint reference."""

    def split(self, entries: list[Entry]) -> tuple[list[Entry], list[tuple[Entry, str]]]:
        """The entries whose inputs are all readable now (references replaced by the
        bytes, viewed in place or fetched), and those that are not, with why."""
        failed = self._fetch_all(entries)
        readable: list[Entry] = []
        lost: list[tuple[Entry, str]] = []
        for entry in entries:
            try:
                for tensor in entry.request.inputs:
                    if tensor.ref is not None:  # in an arena, or its fetch failed
                        tensor.raw = self._resolve(tensor, failed)
                        tensor.ref = None  # packed again (a dead letter), it holds the bytes
            except TensorGone as exc:
                lost.append((entry, str(exc)))
                continue
            readable.append(entry)
        return readable, lost

    def _resolve(self, tensor: Tensor, failed: dict[int, TensorGone]) -> memoryview:
        assert tensor.ref is not None
        gone = failed.get(id(tensor))
        if gone is not None:
            raise gone
        if self._reader is None:
            self._reader = ArenaReader()
        return self._reader.view(tensor.ref)

    def _fetch_all(self, entries: list[Entry]) -> dict[int, TensorGone]:
        """Fetch the bytes of every endpoint reference of ``entries`` into its tensor (its
        reference then gone); why those that could not be had failed, by ``id()`` of
        their tensors, which keep their references."""
        remote = [t for e in entries for t in e.request.inputs
                  if t.ref is not None and is_remote(t.ref)]
        if not remote:
            return {}
        if not isinstance(self._fetch, FetchClient):
            self._fetch = self._fetch()
        failed: dict[int, TensorGone] = {}
        got = self._fetch.fetch([t.ref for t in remote if t.ref is not None])
        for tensor, one in zip(remote, got, strict=True):
            if isinstance(one, TensorGone):
                failed[id(tensor)] = one
            else:
                tensor.raw, tensor.ref = one, None
        return failed
