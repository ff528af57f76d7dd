"""Render the page of current benchmark numbers, `RESULTS.md`, from the rows of `results.jsonl`.

    python tests/benchmarks/render_results.py           # rewrite RESULTS.md
    python tests/benchmarks/render_results.py --check   # exit 1 if the committed page differs

The page is data made readable: `SECTIONS` (results_sections.py) declares each section as data: its tables (which
rows, by id glob, and which columns: a figure with a header and a format, or arithmetic on the rows
of one table line), its goals (each a check computed from rows), a few lines of prose and the notes
file that tells the story. Of the rows a glob matches, a table shows the newest of each case (the
last in the file), so a case measured again shows only its current numbers; a glob that names a
commit picks that run instead. No figure is typed into this file: to change a number, append a row;
to change what the page shows, edit a declaration; then run this script.

A table line gathers the rows its `line` function gives one key (a case's variants side by side);
its last column names every row it shows, which tests/test_harness.py checks exist.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from results_model import (
    MAX_LINES,
    PAGE,
    WIDTH,
    Check,
    Goal,
    Line,
    Rows,
    Section,
    Table,
    load,
    select,
)
from results_sections import HEADER, SECTIONS

# ---- rendering ---------------------------------------------------------------------------------

def lines_of(table: Table, rows: list[dict]) -> list[Line]:
    lines: dict[str, Line] = {}
    for row in select(rows, table.ids):
        key, member = table.line(row)
        lines.setdefault(key, Line(key, {})).members[member] = row
    return list(lines.values())


def render_table(table: Table, rows: list[dict]) -> list[str]:
    lines = lines_of(table, rows)
    if not lines:
        return []
    out = wrap(table.caption) if table.caption else []
    out += ["| " + " | ".join(col.header for col in table.cols) + " |", "|" + "---|" * len(table.cols)]
    return out + ["| " + " | ".join(col.cell(line) for col in table.cols) + " |" for line in lines] + [""]


def render_check(check: Check, rows: Rows) -> tuple[str, bool | None]:
    try:
        value = check.value(rows)
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        return f"{check.label}: no rows yet", None
    met = value >= check.target if check.op == ">=" else value <= check.target
    return f"{check.label} {check.fmt.format(value)} (goal {check.op} {check.fmt.format(check.target)})", met


def render_goal(goal: Goal, rows: Rows) -> str:
    parts, verdicts = zip(*(render_check(check, rows) for check in goal.checks), strict=True)
    verdict = "not measured" if None in verdicts else "**met**" if all(verdicts) else "**not met**"
    return f"- {goal.text}: {', '.join(parts)}: {verdict}."


def wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, break_on_hyphens=False, break_long_words=False)


def render_section(section: Section, rows: list[dict]) -> list[str]:
    out = ["#" * section.level + " " + section.title]
    story = ", ".join(f"`notes/{name.strip()}`" for name in section.notes.split(","))
    out += wrap(f"{section.prose} Story: {story}.")
    out += [render_goal(goal, Rows(rows)) for goal in section.goals] + [""]
    for table in section.tables:
        out += render_table(table, rows)
    return out


def render(rows: list[dict]) -> str:
    out = ["# Benchmark results", ""] + wrap(HEADER) + [""]
    for section in SECTIONS:
        out += render_section(section, rows)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render RESULTS.md from results.jsonl.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the rendering")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write or check (default: %(default)s)")
    args = parser.parse_args(argv)
    page = render(load())
    count = page.count("\n")
    if count > MAX_LINES:
        print(f"the page would have {count} lines, more than {MAX_LINES}: trim a declaration", file=sys.stderr)
        return 1
    if args.check:
        if args.page.read_text() != page:
            print(f"{args.page.name} differs from its rendering: run python tests/benchmarks/{Path(__file__).name}",
                  file=sys.stderr)
            return 1
        return 0
    args.page.write_text(page)
    print(f"wrote {args.page} ({count} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
