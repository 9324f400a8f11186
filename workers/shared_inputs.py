"""Inputs an API process of this host left in its shared tensor arena
(batching/tensor_arena.py), read in place when their entries arrive."""

from __future__ import annotations

from batching.former import Entry
from batching.tensor_arena import ArenaReader, TensorGone


class SharedInputs:
    """Resolves the arena references of arriving entries into views of the arena."""

    def __init__(self, reader: ArenaReader | None = None) -> None:
        self._reader = reader
        """Made on the first reference: a model that never gets one maps nothing."""

    def split(self, entries: list[Entry]) -> tuple[list[Entry], list[tuple[Entry, str]]]:
        """The entries whose inputs are all readable now (references replaced by the
        bytes, viewed in place), and those that are not, with why."""
        readable: list[Entry] = []
        lost: list[tuple[Entry, str]] = []
        for entry in entries:
            try:
                for tensor in entry.request.inputs:
                    if tensor.ref is not None:
                        if self._reader is None:
                            self._reader = ArenaReader()
                        tensor.raw = self._reader.view(tensor.ref)
                        tensor.ref = None  # packed again (a dead letter), it holds the bytes
            except TensorGone as exc:
                lost.append((entry, str(exc)))
                continue
            readable.append(entry)
        return readable, lost
