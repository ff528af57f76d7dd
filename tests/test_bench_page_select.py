"""The page-selection benchmark (tests/benchmarks/bench_page_select_gpu.py) on the CPU, where the
pages stay resident: one row a part a past length, timed through the harness. No figures are claimed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
import bench_page_select_gpu as bench  # noqa: E402


def test_cpu_run_appends_a_row_a_part_a_past_length(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    results = tmp_path / "results.jsonl"
    rows = bench.main(["--shape", "tiny", "--chunk-tokens", "64", "--past", "256,512", "--page-tokens", "16",
                       "--sparse-pages", "4", "--repeats", "1", "--results", str(results)])
    assert [json.loads(line) for line in results.read_text().splitlines()] == rows
    assert [row["case"] for row in rows] == [f"tiny-T64-past{past}/{part}" for past in (256, 512)
                                             for part in ("select", "fetch", "forward", "keep")]
    for row in rows:
        assert row["figures"]["median_ms"] > 0 and row["config"]["pages"] == row["config"]["past"] // 16
    assert rows[0]["figures"]["tflops"] > 0 and rows[0]["figures"]["gb_s"] > 0
