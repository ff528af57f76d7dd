"""The results page is the rendering of the result rows, short enough to read, and what cites it
resolves.

Citation syntax, in the library's comments, docstrings and help texts, the README and the notes:
- a section of the page: `RESULTS.md, "<section title>"` (the path before it as the text needs; the
  quoted title is a heading of the page, exactly);
- a section of the notes: `notes/<file>.md, "<start of a section heading>"`;
- rows: an id or an id glob in backticks, `bench/case@commit`, where `*`, `<...>` and `...` stand
  for any text and `{a,b}` for alternatives; it must match at least one row of results.jsonl.
A bare `RESULTS.md` names the whole page; `RESULTS.md,` followed by anything but a quoted title is a
citation that lost its quotes, and fails.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tests" / "benchmarks"
NOTES = BENCH / "notes"
LIBRARY = ("distill", "teacher_cache", "student", "kernels", "pipelines")

SECTION = re.compile(r'RESULTS\.md`?,\s*(?:#\s*)?\\?"([^"\\]+)\\?"')
UNQUOTED = re.compile(r'RESULTS\.md`?,(?![\s#]*\\?")')
NOTE_SECTION = re.compile(r'notes/([\w-]+\.md)`?,\s*(?:#\s*)?\\?"([^"\\]+)\\?"')
NOTE_FILE = re.compile(r"notes/([\w-]+\.md)")
ROW = re.compile(r"`([a-z][a-z0-9_]*/[^`\s]+)`")


def _renderer():
    if str(BENCH) not in sys.path:  # the renderer imports its sibling modules (results_model, results_sections)
        sys.path.insert(0, str(BENCH))
    import render_results

    return render_results


def _citing_files() -> list[Path]:
    files = [path for package in LIBRARY for path in sorted((ROOT / package).rglob("*.py"))]
    return files + [ROOT / "README.md"] + sorted(NOTES.glob("*.md"))


def _one_line(text: str) -> str:
    """A quoted title broken over comment lines, joined again."""
    return " ".join(re.sub(r"^\s*#\s?", "", part) for part in text.splitlines()).strip()


def _headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]


def _expand(pattern: str) -> list[str]:
    """`{a,b}` alternatives, then `<...>` and `...` as `*`."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    globs = ["".join(combo) for combo in itertools.product(*choices)]
    return [re.sub(r"<[^>]*>|\.\.\.", "*", glob) for glob in globs]


def test_the_committed_page_is_the_rendering_of_the_rows():
    render = _renderer()
    page = render.render(render.load())
    assert (BENCH / "RESULTS.md").read_text() == page, (
        "RESULTS.md differs from its rendering: run python tests/benchmarks/render_results.py")


def test_the_page_fits_in_250_lines():
    assert len((BENCH / "RESULTS.md").read_text().splitlines()) <= 250


def test_the_check_mode_fails_on_a_page_edited_by_hand(tmp_path):
    render = _renderer()
    page = tmp_path / "RESULTS.md"
    page.write_text(render.render(render.load()))
    assert render.main(["--check", "--page", str(page)]) == 0
    page.write_text(page.read_text().replace("**met**", "**not met**", 1))
    assert render.main(["--check", "--page", str(page)]) == 1


def test_a_case_measured_again_shows_its_newest_row():
    render = _renderer()
    rows = [{"id": f"b/c@{commit}", "bench": "b", "case": "c", "figures": {"x": x}}
            for commit, x in (("aaaaaaa", 1.0), ("bbbbbbb", 2.0))]
    assert [row["id"] for row in render.select(rows, ("b/*",))] == ["b/c@bbbbbbb"]
    assert [row["id"] for row in render.select(rows, ("b/*@aaaaaaa",))] == ["b/c@aaaaaaa"]


@pytest.mark.parametrize("path", _citing_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_citation_of_the_page_names_one_of_its_sections(path):
    text = path.read_text()
    sections = set(_headings(BENCH / "RESULTS.md"))
    assert not [m.group(0) for m in UNQUOTED.finditer(text)], "cite a section as RESULTS.md, \"<title>\""
    cited = {_one_line(m.group(1)) for m in SECTION.finditer(text)}
    assert not cited - sections, f"no such section of RESULTS.md: {sorted(cited - sections)}"


@pytest.mark.parametrize("path", _citing_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_citation_of_the_notes_names_a_file_and_section_there(path):
    text = path.read_text()
    missing = {name for name in NOTE_FILE.findall(text) if not (NOTES / name).exists()}
    assert not missing, f"no such notes file: {sorted(missing)}"
    for name, title in NOTE_SECTION.findall(text):
        title = _one_line(title)
        assert any(h.startswith(title) for h in _headings(NOTES / name)), f"no section {title!r} in notes/{name}"


@pytest.mark.parametrize("path", _citing_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_cited_row_id_matches_a_row(path):
    rows = [json.loads(line) for line in (BENCH / "results.jsonl").read_text().splitlines() if line.strip()]
    ids, benches = [row["id"] for row in rows], {row["bench"] for row in rows}
    # A row id starts with a bench's name; a source path that shares it (`offload/config.py`) is no citation.
    cited = [m for m in ROW.findall(path.read_text()) if m.split("/")[0] in benches and not m.endswith(".py")]
    unmatched = [c for c in cited if not any(fnmatch.filter(ids, glob) for glob in _expand(c))]
    assert not unmatched, f"cited rows that match no row of results.jsonl: {unmatched}"


def test_backfilled_rows_name_a_notes_section():
    for line in (BENCH / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "backfilled_from" in row:
            name, _, section = row["backfilled_from"].partition(" § ")
            assert section in _headings(BENCH / name), row["id"]
