"""The batching simulator's tables (``bench.sim_scenarios``), printed or written into the docs.

Usage: python -m bench.simulate [--duration S] [--seed N] [--write [docs/batching.md]]

Deterministic for a seed; takes a few seconds. ``--write`` replaces what lies between the
``simulate:begin`` and ``simulate:end`` markers of the document.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.sim_scenarios import report

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "batching.md"
BEGIN = "<!-- simulate:begin -->"
END = "<!-- simulate:end -->"


def write_into(doc: Path, tables: str) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{tables}{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=2.0, help="seconds of each trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", nargs="?", const=str(DOC), default=None, metavar="DOC",
                        help=f"write the tables into DOC (default {DOC.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    tables = report(args.duration, args.seed)
    if args.write:
        write_into(Path(args.write), tables)
    else:
        sys.stdout.write(tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
