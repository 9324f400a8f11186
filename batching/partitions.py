"""Which partition of a model a request, or a job's chunks, enter (``queue.partitions``).

Round robin per model and per process, from a random first partition, so that many
processes that each send a few requests still spread them: the rows waiting in the
partitions stay within a request or two of each other, which is what lets each
partition's share of ``max_queue_rows`` add up to about the model's limit
(docs/data-path.md, "Partitions").
"""

from __future__ import annotations

import random


class Spread:
    """The next partition of each model, in turn."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def pick(self, model: str, count: int) -> int:
        """The partition (0 to ``count`` - 1) of the next request for ``model``."""
        if count <= 1:
            return 0
        turn = self._next.get(model)
        if turn is None:
            turn = random.randrange(count)
        self._next[model] = turn + 1
        return turn % count
