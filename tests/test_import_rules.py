"""The layers' import rules, read from the source with :mod:`ast`.

``batching/`` imports neither FastAPI, Celery nor anything of ``api/`` or ``workers/``;
``workers/`` never imports ``api/``; ``api/`` never imports ``workers/``. Every import
counts, wherever it stands (inside a function or under ``TYPE_CHECKING`` too), in the
``import x``, ``from x import y`` and relative forms.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "batching": ("fastapi", "celery", "api", "workers"),
    "api": ("workers",),
    "workers": ("api",),
}


def imports_of(source: str, folder: tuple[str, ...]) -> list[tuple[int, str]]:
    """Each absolute module name the source imports, with its line.

    ``folder`` is the package the file lives in (``("batching",)`` for ``batching/keys.py``
    and for ``batching/__init__.py`` alike), which relative imports start from; ``from x
    import y`` counts as ``x.y``, since ``y`` may be a module.
    """
    names: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = list(folder[:len(folder) - node.level + 1]) if node.level else []
            parts += node.module.split(".") if node.module else []
            names += [(node.lineno, ".".join([*parts, alias.name])) for alias in node.names]
    return sorted(names, key=lambda found: found[0])


def breaks(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == root or name.startswith(f"{root}.") for root in roots)


def violations(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        folder = path.relative_to(ROOT).parent.parts
        for line, name in imports_of(path.read_text(), folder):
            if breaks(name, FORBIDDEN[package]):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_keeps_its_import_rules(package: str) -> None:
    assert violations(package) == []


def test_every_import_form_is_read() -> None:
    source = ("import fastapi.responses, json\nfrom celery import Celery\n"
              "def f() -> None:\n    from ..workers import app\n"
              "from .. import api\nfrom . import keys\nfrom .keys import Keys\n")
    names = [name for _, name in imports_of(source, ("batching",))]
    assert names == ["fastapi.responses", "json", "celery.Celery", "workers.app", "api",
                     "batching.keys", "batching.keys.Keys"]
    assert [n for n in names if breaks(n, FORBIDDEN["batching"])] == [
        "fastapi.responses", "celery.Celery", "workers.app", "api"]
    assert not breaks("apis", ("api",))


def module_graph(package: str) -> dict[str, set[str]]:
    """Which of the package's own modules each of its modules imports."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        named = {name for _, name in imports_of(path.read_text(), path.relative_to(ROOT).parent.parts)}
        graph[module] = {other for other in paths if other != module
                         and any(breaks(name, (other,)) for name in named)}
    return graph


def test_batching_modules_import_each_other_in_one_direction() -> None:
    graph = module_graph("batching")
    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if a < b and a in graph[b])
    assert cycles == []
