"""What the client host wrote down (tests/multihost/load.py), read as it grows, and the
figures the multi-host test reports from it."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Answers:
    """The load's JSON lines: ``ready``, one line per request, then ``sent`` and ``end``."""

    path: Path
    requests: list[dict[str, Any]] = field(default_factory=list)
    ready: float | None = None
    end: dict[str, Any] | None = None
    _offset: int = 0

    def read(self) -> Answers:
        """Take in the complete lines written since the last read."""
        if not self.path.exists():
            return self
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for raw in complete.splitlines():
            line = json.loads(raw)
            if "ready" in line:
                self.ready = float(line["ready"])
            elif "sent" in line and "status" not in line:
                self.end = line
            else:
                self.requests.append(line)
        return self

    def done_after(self, t: float, api: int | None = None, status: int | None = 200) -> int:
        """Requests answered after ``t`` (of one API, with one status: None for any)."""
        return sum(1 for r in self.requests if r["done"] > t
                   and (api is None or r["api"] == api) and (status is None or r["status"] == status))

    def failed_clients(self, api: int) -> set[int]:
        return {r["client"] for r in self.requests if r["api"] == api and r["status"] == 0}

    def by_status(self, api: int | None = None) -> dict[str, int]:
        counts = Counter(str(r["status"]) for r in self.requests if api is None or r["api"] == api)
        return dict(sorted(counts.items()))


def rate(answers: Answers, start: float, end: float, api: int | None = None) -> float:
    """200s a second answered between ``start`` and ``end``."""
    n = sum(1 for r in answers.requests if start < r["done"] <= end and r["status"] == 200
            and (api is None or r["api"] == api))
    return n / (end - start) if end > start else 0.0


def slowest(answers: Answers, start: float, end: float) -> float:
    """The longest wait (s) of a request sent between ``start`` and ``end``."""
    return max((r["done"] - r["sent"] for r in answers.requests if start <= r["sent"] < end),
               default=0.0)


def lowest_second(answers: Answers, start: float, end: float) -> float:
    """The fewest 200s answered in any whole second between ``start`` and ``end``."""
    seconds = int(end - start)
    if seconds < 1:
        return rate(answers, start, end)
    counts = [0] * seconds
    for r in answers.requests:
        k = int(r["done"] - start)
        if r["status"] == 200 and 0 <= k < seconds:
            counts[k] += 1
    return float(min(counts))
