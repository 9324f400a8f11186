"""Which tests start processes, read from their code: tests/conftest.py marks them
``integration``, so ``make test-unit`` (``-m "not integration"``) runs only in-process tests.

A test starts processes when its function, a fixture it uses (directly or through other
fixtures), or any code of this repository that one of them names refers to a process
starter: anything of ``subprocess``, ``asyncio.subprocess`` or
``concurrent.futures.process``, or a process-starting name of any module
(``ctx.Process``, ``os.fork``...: shared memory of ``multiprocessing`` does not count). So
redis-server, the API and Celery workers (tests/procs.py over conveyor/harness.py), a
``python -c`` child and a protoc run all count, and a new test or helper needs no marker
by hand. The reading is by name, over every method of a class it names: it may mark a test
that names a process-starting class or helper without calling that part of it (the worker
probe test names ``Supervisor``), never miss one that calls it.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = Path(sys.prefix).resolve()
STARTERS = ("subprocess", "asyncio.subprocess", "concurrent.futures.process")
"""Modules all of whose use starts processes."""
PROCESS_NAMES = frozenset({"Process", "Pool", "Popen", "fork", "forkpty", "posix_spawn",
                           "posix_spawnp", "create_subprocess_exec", "create_subprocess_shell"})
"""Names that start a process whatever holds them (a multiprocessing context, ``os``)."""


def starts_processes(item: pytest.Item, known: dict[int, bool]) -> bool:
    """Whether ``item``'s code or its fixtures' may start a process; ``known`` caches the
    answer per function and class across items."""
    info = getattr(item, "_fixtureinfo", None)
    fixtures = [defs[-1].func for defs in info.name2fixturedefs.values()] if info else []
    return any(_starts(obj, known) for obj in (getattr(item, "obj", None), *fixtures))


def _module(obj: Any) -> str:
    return obj.__name__ if isinstance(obj, ModuleType) else str(getattr(obj, "__module__", ""))


def _is_starter(obj: Any) -> bool:
    module = _module(obj)
    return any(module == s or module.startswith(f"{s}.") for s in STARTERS)


def _ours(module: str) -> bool:
    """Code of this repository (tests, helpers, the packages), not an installed library."""
    path = getattr(sys.modules.get(module), "__file__", None)
    if path is None:
        return False
    resolved = Path(path).resolve()
    return resolved.is_relative_to(ROOT) and not resolved.is_relative_to(INSTALLED)


def _starts(obj: Any, known: dict[int, bool]) -> bool:
    obj = inspect.unwrap(getattr(obj, "__func__", obj)) if callable(obj) else obj
    if id(obj) in known:
        return known[id(obj)]
    known[id(obj)] = False  # while being read: a cycle adds nothing
    found = _is_starter(obj) or (not isinstance(obj, ModuleType) and _ours(_module(obj))
                                 and _reads_a_starter(obj, known))
    known[id(obj)] = found
    return found


def _reads_a_starter(obj: Any, known: dict[int, bool]) -> bool:
    if isinstance(obj, type):
        members = [m for cls in obj.__mro__ if _ours(cls.__module__) for m in vars(cls).values()]
        return any(_starts(m.fget if isinstance(m, property) else m, known) for m in members)
    code, names = getattr(obj, "__code__", None), getattr(obj, "__globals__", None)
    return isinstance(code, CodeType) and names is not None and _code_starts(code, names, known)


def _code_starts(code: CodeType, names: dict[str, Any], known: dict[int, bool]) -> bool:
    """Whether ``code`` (nested functions and lambdas included) names a starter, or code of
    ours that does; ``module.attribute`` is followed for every attribute the code names."""
    if PROCESS_NAMES.intersection(code.co_names):
        return True
    for name in code.co_names:
        value = names.get(name)
        if isinstance(value, ModuleType) and not _is_starter(value):
            if _ours(value.__name__) and any(_starts(vars(value)[n], known)
                                             for n in code.co_names if n in vars(value)):
                return True
        elif value is not None and _starts(value, known):
            return True
    return any(_code_starts(const, names, known) for const in code.co_consts
               if isinstance(const, CodeType))
