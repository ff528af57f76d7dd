"""The benchmark harness (tests/benchmarks/harness.py): rows, CPU timing, the correctness gate."""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
import harness  # noqa: E402

FIELDS = {"id", "bench", "case", "date", "commit", "device", "command", "figures", "config"}


def strict_rows(path: Path) -> list[dict]:
    """Each line parsed as standard JSON (NaN / Infinity refused)."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_results_appends_one_valid_row_per_add(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234-dirty")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    path = tmp_path / "sub" / "results.jsonl"
    results = harness.Results(bench="demo", path=path)
    results.add("V10/ours", {"median_ms": 1.5, "peak_gib": float("nan"), "n": torch.tensor(3)}, {"k": 4})
    results.add("V10/ref", {"median_ms": 2.0})
    rows = strict_rows(path)
    assert len(rows) == 2 and rows == results.rows
    for row, case in zip(rows, ("V10/ours", "V10/ref")):
        assert set(row) == FIELDS
        assert row["bench"] == "demo" and row["case"] == case
        assert row["id"] == f"demo/{case}@abc1234" and row["commit"] == "abc1234-dirty"
        datetime.datetime.strptime(row["date"], "%Y-%m-%dT%H:%M:%SZ")
        assert row["device"] and row["command"].startswith(Path(sys.executable).name + " ")
    assert rows[0]["figures"] == {"median_ms": 1.5, "peak_gib": None, "n": 3}
    assert rows[0]["config"] == {"k": 4} and rows[1]["config"] == {}


def test_a_rows_command_carries_the_allocator_setting_it_ran_under(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    row = harness.Results(bench="demo", path=tmp_path / "r.jsonl").add("a", {"x": 1.0})
    assert row["command"].startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True " + Path(sys.executable).name)


def test_results_ids_stay_unique_in_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    path = tmp_path / "results.jsonl"
    harness.Results(bench="demo", path=path).add("a", {"x": 1.0})
    again = harness.Results(bench="demo", path=path)
    again.add("a", {"x": 2.0})
    again.add("a", {"x": 3.0})
    assert [r["id"] for r in harness.load_rows(path)] == ["demo/a@abc1234", "demo/a@abc1234#2", "demo/a@abc1234#3"]


def test_load_rows_reads_back_in_order(tmp_path):
    path = tmp_path / "results.jsonl"
    assert harness.load_rows(path) == []
    results = harness.Results(bench="demo", path=path)
    added = [results.add(f"case{i}", {"ms": float(i)}) for i in range(3)]
    assert harness.load_rows(path) == added


def test_time_cpu_counts_repeats():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    timing = harness.time_cpu(fn, warmup=2, repeats=5)
    assert len(calls) == 7 and len(timing.times_ms) == 5
    assert all(t >= 2.0 for t in timing.times_ms)
    figures = timing.figures()
    assert figures["repeats"] == 5 and figures["min_ms"] <= figures["median_ms"] <= figures["max_ms"]


def test_check_close_passes_within_tolerance_and_returns_the_error():
    want = torch.tensor([1.0, 2.0, float("nan"), float("-inf")])
    got = torch.tensor([1.001, 2.0, float("nan"), float("-inf")])
    assert harness.check_close("ok", got, want, atol=2e-3) == pytest.approx(1e-3, rel=1e-3)
    assert harness.check_close("rtol", torch.tensor([110.0]), torch.tensor([100.0]), atol=0, rtol=0.1) == 10.0


@pytest.mark.parametrize("got, want", [
    ([1.0, 2.1], [1.0, 2.0]),                     # out of tolerance
    ([1.0, float("nan")], [1.0, 2.0]),            # NaN in the result
    ([1.0, float("inf")], [1.0, 2.0]),            # infinity in the result
    ([1.0, 2.0], [1.0, float("nan")]),            # a number where the reference has NaN
    ([1.0, float("inf")], [1.0, float("-inf")]),  # the wrong infinity
    ([1.0, 2.0, 3.0], [1.0, 2.0]),                # shape
])
def test_check_close_raises_naming_the_variant(got, want):
    with pytest.raises(AssertionError, match="^mine: "):
        harness.check_close("mine", torch.tensor(got), torch.tensor(want), atol=1e-2)


def test_rates():
    assert harness.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert harness.gbps(4e9, 2.0) == pytest.approx(2000.0)


def test_results_file_and_page_agree():
    """Every row of results.jsonl is strict JSON with every field; every id RESULTS.md cites is a
    row there (ids are unique), so the page never points at a measurement that does not exist."""
    import re

    here = Path(__file__).parent / "benchmarks"
    rows = strict_rows(here / "results.jsonl")
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids))
    for row in rows:
        assert FIELDS <= set(row), row["id"]
        assert row["id"] == f"{row['bench']}/{row['case']}@{row['commit'].split('-')[0]}" or "#" in row["id"]
    page = (here / "RESULTS.md").read_text()
    cited = set(re.findall(r"`([a-z_0-9]+/[^`@ <]+@[0-9a-f]{7}(?:#\d+)?)`", page))
    # A table may name its rows in short, `<shape>/<case>`, under a header `bench/<shape>/...@commit`.
    for bench, commit, table in re.findall(r"rows \(`([a-z_]+)/<shape>/\.\.\.@([0-9a-f]{7})`\) \|\n((?:\|.*\n)+)", page):
        cited |= {f"{bench}/{case}@{commit}" for case in re.findall(r"`([^`/]+/[^`]+)`", table)}
    assert len(cited) > 20, "RESULTS.md cites (almost) no rows"
    assert not cited - set(ids), sorted(cited - set(ids))


def test_the_host_peak_is_the_processs_since_its_reset():
    """Linux's peak resident size, reset to the resident size now: 256 MiB of fresh pages (an
    anonymous mapping: memory the allocator may already hold resident would not move the peak)
    touched and unmapped after the reset raise the peak by about that and leave the resident
    size where it was."""
    import mmap

    before = harness.reset_host_peak()
    if before is None:
        pytest.skip("no /proc/self/clear_refs here")
    assert before <= harness.host_peak() < before + 64 * 2**20
    size = 256 * 2**20
    block = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):  # a page at a time: no buffer of that size elsewhere
        block[offset] = 1
    block.close()
    assert harness.host_peak() >= before + 250 * 2**20
    assert harness.reset_host_peak() < before + 64 * 2**20
