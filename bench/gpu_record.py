"""The GPU benchmark's records and phases: every record is one JSON line on stdout and in
OUT/gpu.json (so that a run cut short still leaves what it measured), and every phase runs
under a time box and an overall deadline, a failure recorded and the next phase run anyway.
"""

from __future__ import annotations

import json
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Recorder:
    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "gpu.json"
        self.path.write_text("")
        self.records: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def emit(self, kind: str, **data: Any) -> dict[str, Any]:
        record = {"kind": kind, "t": round(time.monotonic() - self.started, 1), **data}
        self.records.append(record)
        line = json.dumps(record, default=str)
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")
        return record

    def find(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == kind]


class PhaseTimeout(Exception):
    pass


def _alarm(_signum: int, _frame: object) -> None:
    raise PhaseTimeout("phase time box exceeded")


class Phases:
    """Runs each phase under a time box (SIGALRM) and an overall deadline; never raises."""

    def __init__(self, rec: Recorder, budget_s: float) -> None:
        self.rec = rec
        self.deadline = time.monotonic() + budget_s
        self.status: dict[str, str] = {}
        signal.signal(signal.SIGALRM, _alarm)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, limit_s: float, action: Callable[[], None],
            reserve_s: float = 20.0) -> bool:
        limit = min(limit_s, self.left() - reserve_s)
        if limit < 5:
            self.status[name] = "skipped (no time left)"
            self.rec.emit("phase", phase=name, ok=False, error="skipped: overall budget spent")
            return False
        started = time.monotonic()
        self.rec.emit("phase_start", phase=name, limit_s=round(limit))
        signal.alarm(max(1, int(limit)))
        try:
            action()
        except (Exception, PhaseTimeout) as exc:
            signal.alarm(0)
            self.status[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
            self.rec.emit("phase", phase=name, ok=False, seconds=round(time.monotonic() - started, 1),
                          error=f"{type(exc).__name__}: {exc}"[:2000],
                          traceback=traceback.format_exc()[-3000:])
            return False
        finally:
            signal.alarm(0)
        self.status.setdefault(name, "ok")
        self.rec.emit("phase", phase=name, ok=True, seconds=round(time.monotonic() - started, 1))
        return True
