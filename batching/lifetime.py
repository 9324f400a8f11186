"""Processes that die with their parent (Linux's ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def die_with_parent(sig: int, parent_pid: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent ends.

    Strictly: when the thread that started this process ends, so a parent must start such
    children from a thread that lives as long as they should. ``parent_pid`` (default: the
    multiprocessing parent, if any) closes the race of a parent that died before this
    call: then ``sig`` comes at once. Safe in a ``preexec_fn`` of a parent without threads.
    """
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if parent_pid is None:
        parent = multiprocessing.parent_process()
        parent_pid = parent.pid if parent is not None else None
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
