"""docs/configuration.md's environment-variable table agrees with ``batching.settings.Settings``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from batching.settings import Settings
from conveyor.settings_table import Row, default_cell, differences, rows

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = ROOT / "docs" / "configuration.md"


def test_the_documented_table_names_every_setting_with_its_default() -> None:
    assert differences(CONFIGURATION.read_text()) == []


def test_each_kind_of_mismatch_is_reported() -> None:
    rewritten = {f"`CONVEYOR_{n}`" for n in ("MODELS", "HOST", "REDIS_URL", "MAX_REQUEST_BYTES")}
    kept = [r._replace(effect="x") for r in rows() if r.variable not in rewritten]
    table = [
        Row("`CONVEYOR_REDIS_URL`", "`redis://elsewhere`", "x"),
        Row("`CONVEYOR_NO_SUCH`", "`1`", "x"),
        Row("`CONVEYOR_MAX_REQUEST_BYTES`", "`67108864` (64 MiB)", "x"),
        Row("`CONVEYOR_HOST`", "`127.0.0.1`", " "),
        *kept,
        Row("`CONVEYOR_KEY_PREFIX`", "`cv`", "again"),
    ]
    body = "\n".join(f"| {r.variable} | {r.default} | {r.effect} |" for r in table)
    markdown = f"# Configuration\n\n## Environment variables\n\n{body}\n\n## Model repository\n"
    assert differences(markdown) == [
        "`CONVEYOR_REDIS_URL` defaults to `redis://127.0.0.1:6379/0`, not `redis://elsewhere`",
        "`CONVEYOR_NO_SUCH` is not a setting",
        "`CONVEYOR_HOST` has no effect",
        "`CONVEYOR_KEY_PREFIX` is documented twice",
        "`CONVEYOR_MODELS` is missing",
    ]


def test_defaults_are_written_as_the_table_writes_them() -> None:
    assert [default_cell(v) for v in (None, "", False, Path("models"), 0, 1.0, "none")] == [
        "unset", "empty", "`false`", "`./models`", "`0`", "`1.0`", "`none`",
    ]


def test_rows_carry_each_fields_docstring() -> None:
    by_name = {r.variable: r for r in rows()}
    assert len(by_name) == len(Settings.model_fields)
    events = by_name["`CONVEYOR_BATCH_EVENTS_PER_S`"]
    assert events.default == "`100`"
    assert events.effect.startswith("Most Celery task events (three per executed batch, for Flower) an")
    assert by_name["`CONVEYOR_JOB_MAX_IN_FLIGHT`"].default == "`0`"


def test_the_module_prints_the_rows() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "conveyor.settings_table"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    assert out.splitlines()[0] == "| variable | default | effect |"
    assert "| `CONVEYOR_JOB_MAX_IN_FLIGHT` | `0` | Chunks of one job admitted" in out
    assert len(out.splitlines()) == 2 + len(Settings.model_fields)
