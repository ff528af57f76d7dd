"""The host-copy benchmark (tests/benchmarks/bench_host_copies_gpu.py): on a CPU-only machine it
refuses in one line; its option checks. The copies themselves need a GPU (no figures here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
import bench_host_copies_gpu as bench  # noqa: E402


def test_unknown_options_are_refused_naming_the_option(tmp_path):
    for argv, option in ((["--memory", "pageable"], "--memory"), (["--spans", "2GiBx4"], "--spans")):
        with pytest.raises(SystemExit, match=option):
            bench.main([*argv, "--results", str(tmp_path / "r.jsonl")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU-only machine's answer")
def test_a_cpu_only_machine_is_told_it_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main(["--results", str(tmp_path / "r.jsonl")])
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.gpu
def test_each_case_gives_a_rate_per_direction_it_copies(tmp_path):
    rows = bench.main(["--spans", "64MiBx1", "--repeats", "2", "--results", str(tmp_path / "r.jsonl")])
    assert [row["case"] for row in rows] == [f"{m}-64MiBx1/{d}" for m in ("pinned", "registered")
                                             for d in ("h2d", "d2h", "both")]
    for row in rows:
        ways = {"h2d": {"h2d_gb_s"}, "d2h": {"d2h_gb_s"}, "both": {"h2d_gb_s", "d2h_gb_s"}}[row["config"]["direction"]]
        assert {k for k in row["figures"] if k.endswith("_gb_s")} == ways
        assert all(row["figures"][k] > 1.0 for k in ways)
    # The bus is full duplex: copies each way at once overlap, so each keeps well over half its rate
    # alone (a version that queued one direction behind the other gave half of each).
    by_case = {row["case"]: row["figures"] for row in rows}
    for m in ("pinned", "registered"):
        for way in ("h2d", "d2h"):
            assert by_case[f"{m}-64MiBx1/both"][f"{way}_gb_s"] > 0.7 * by_case[f"{m}-64MiBx1/{way}"][f"{way}_gb_s"], m
