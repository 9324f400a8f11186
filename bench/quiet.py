"""Waiting for the host to go quiet between two runs of a benchmark that share it.

Past capacity a stack still holds work when its run's clients stop: requests read and
queued, up to their timeout, that its processes go on serving (or expiring) after the
run. The next run on the same cores, another policy's, would pay for them. So between
runs the benchmark waits until the host's CPUs have been mostly idle for a while, judged
from ``/proc/stat`` (every process on the host: the stacks, Redis, Triton).
"""

from __future__ import annotations

import time
from pathlib import Path

STAT = Path("/proc/stat")
WINDOW_S = 0.1
"""How long each look at the CPUs lasts."""
BUSY_SHARE = 0.2
"""A window whose CPUs were busy at most this share of the time (all cores) is quiet."""
QUIET_WINDOWS = 3
"""Windows on end that must be quiet."""


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [int(v) for v in STAT.read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already in user
    return total - idle, total


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of CPU time busy between two :func:`cpu_times` readings."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def wait_quiet(most_s: float, window_s: float = WINDOW_S, busy: float = BUSY_SHARE,
               windows: int = QUIET_WINDOWS) -> float:
    """Wait until ``windows`` windows of ``window_s`` on end have had the CPUs busy at
    most ``busy`` of the time, or ``most_s`` has passed; the seconds waited."""
    start = time.monotonic()
    quiet = 0
    before = cpu_times()
    while quiet < windows and time.monotonic() - start < most_s:
        time.sleep(window_s)
        after = cpu_times()
        quiet = quiet + 1 if busy_share(before, after) <= busy else 0
        before = after
    return time.monotonic() - start
