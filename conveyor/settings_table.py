"""The environment-variable table of docs/configuration.md, rendered from :class:`Settings`.

``python -m conveyor.settings_table`` prints one Markdown row per setting: its variable
(``CONVEYOR_<FIELD>``), its default and the field's docstring. Paste a new setting's row
into docs/configuration.md and say more in its effect column where it helps;
tests/test_settings_table.py fails while the table there names a variable that is not a
setting, misses one, or shows another default than the code.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import NamedTuple

from batching import settings as settings_module
from batching.settings import Settings

PREFIX = "CONVEYOR_"
TABLE_HEADING = "## Environment variables"


class Row(NamedTuple):
    variable: str
    default: str
    effect: str


def field_docs() -> dict[str, str]:
    """Each field's attribute docstring (the string right below it), whitespace folded."""
    tree = ast.parse(inspect.getsource(settings_module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == Settings.__name__)
    docs: dict[str, str] = {}
    for stmt, after in zip(cls.body, cls.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def default_cell(value: object) -> str:
    """How the table writes a default: a code span, or ``unset`` / ``empty``."""
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, Path) and not value.is_absolute():
        return f"`./{value.as_posix()}`"
    return f"`{value}`"


def rows() -> list[Row]:
    """One row per setting, in the order :class:`Settings` declares them."""
    docs = field_docs()
    return [
        Row(f"`{PREFIX}{name.upper()}`", default_cell(field.default), docs.get(name, ""))
        for name, field in Settings.model_fields.items()
    ]


def render() -> str:
    lines = ["| variable | default | effect |", "|---|---|---|"]
    lines += [f"| {r.variable} | {r.default} | {r.effect} |" for r in rows()]
    return "\n".join(lines)


_ROW = re.compile(r"^\| (`[A-Z0-9_]+`) \| (.*?) \| (.*) \|$")


def documented(markdown: str) -> list[Row]:
    """The rows of the table under :data:`TABLE_HEADING` in ``markdown``."""
    section = markdown.split(f"\n{TABLE_HEADING}\n", 1)[1].split("\n## ", 1)[0]
    found: list[Row] = []
    for line in section.splitlines():
        match = _ROW.match(line)
        if match:
            found.append(Row(*match.groups()))
    return found


def differences(markdown: str) -> list[str]:
    """Where the documented table disagrees with :func:`rows`; empty when it agrees.

    A documented default may add a note after the generated one (``(64 MiB)``); the
    effect column must say something, in its own words.
    """
    expected = {r.variable: r for r in rows()}
    seen: set[str] = set()
    problems: list[str] = []
    for row in documented(markdown):
        want = expected.get(row.variable)
        if want is None:
            problems.append(f"{row.variable} is not a setting")
        elif row.variable in seen:
            problems.append(f"{row.variable} is documented twice")
        elif row.default != want.default and not row.default.startswith(want.default + " "):
            problems.append(f"{row.variable} defaults to {want.default}, not {row.default}")
        elif not row.effect.strip():
            problems.append(f"{row.variable} has no effect")
        seen.add(row.variable)
    problems += [f"{name} is missing" for name in expected if name not in seen]
    return problems


if __name__ == "__main__":
    print(render())
