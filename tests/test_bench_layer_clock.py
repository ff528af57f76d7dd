"""bench_layer_clock_gpu.py on the CPU: its three phases run and make one row (the device's
clock, what it measures, is only on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
import bench_layer_clock_gpu as bench  # noqa: E402


def test_the_three_phases_run_and_make_one_row(tmp_path):
    rows = bench.main(["--device", "cpu", "--shape", "tiny", "--seq-len", "32", "--seconds", "0.05",
                       "--repeats", "3", "--gap-ms", "0", "--results", str(tmp_path / "r.jsonl")])
    (row,) = rows
    f = row["figures"]
    assert row["id"].startswith("layer_clock/tiny-T32@")
    assert len(f["burst_all_ms"]) == len(f["sustained_last_ms"]) == len(f["hot_burst_all_ms"]) == 3
    assert f["sustained_runs"] >= 3 and all(t > 0 for t in f["burst_all_ms"] + f["sustained_last_ms"])
    assert f["sustained_over_burst"] == f["sustained_ms"] / f["burst_ms"]


def test_by_second_takes_the_median_of_the_runs_ending_in_each_whole_second():
    # runs of 400, 400, 300 ms end at 0.4, 0.8, 1.1 s; then 500, 600 end at 1.6, 2.2 (partial: left out)
    assert bench.by_second([400, 400, 300, 500, 600]) == [400, 400]
    assert bench.by_second([250] * 8 + [100]) == [250, 250]  # a run ending at exactly 1.0 s counts in the next second
    assert bench.by_second([300]) == []
