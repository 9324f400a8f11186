"""Write the metric tables of docs/metrics.md from api/metric_defs.py.

``python -m api.metrics_doc`` rewrites each table between its markers and leaves the
prose around them as it is; ``--check`` only says whether the file is up to date (exit
status 1 if not). Each section's table starts at a line ``<!-- metrics table: SECTION -->``
and ends at the next ``<!-- end of metrics table -->``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from api.metric_defs import ALL, SECTIONS

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
END = "<!-- end of metrics table -->"


def begin(section: str) -> str:
    return f"<!-- metrics table: {section} -->"


def table(section: str) -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for metric in ALL:
        if metric.section == section:
            labels = ", ".join(f"`{label}`" for label in metric.labels)
            rows.append(f"| `{metric.name}` | {metric.kind} | {labels} | {metric.doc} |")
    return "\n".join(rows)


def render(text: str) -> str:
    """``text`` with every section's table written anew; ValueError if a marker is missing."""
    for section in SECTIONS:
        start = text.find(begin(section))
        end = text.find(END, start)
        if start < 0 or end < 0:
            raise ValueError(f"docs/metrics.md has no '{begin(section)}' ... '{END}'")
        head = start + len(begin(section))
        text = f"{text[:head]}\n{table(section)}\n{text[end:]}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/metrics.md differs from what would be written")
    args = parser.parse_args(argv)
    current = DOC.read_text()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print("docs/metrics.md is out of date: run python -m api.metrics_doc",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
