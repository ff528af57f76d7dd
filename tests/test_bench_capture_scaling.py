"""The capture scaling benchmark (tests/benchmarks/bench_capture_scaling_gpu.py): its check that every
world size built the reference's cache, the shard count it refuses, and the whole benchmark tiny on
the CPU (gloo, 1 and 2 processes through torchrun). No figures are claimed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
import bench_capture_scaling_gpu as bench  # noqa: E402


def manifest(cache_id="c0", checksums=("sha256:a", "sha256:b", "sha256:c"), status="complete"):
    shards = [SimpleNamespace(name=f"{i:05d}.parquet", checksum=c) for i, c in enumerate(checksums)]
    return SimpleNamespace(cache_id=cache_id, shards=shards, status=status)


@pytest.mark.parametrize("got, named", [
    (manifest(checksums=("sha256:a", "sha256:x", "sha256:c")), "00001.parquet"),
    (manifest(checksums=("sha256:a", "sha256:b")), "00002.parquet"),
    (manifest(checksums=("sha256:a", "sha256:b", "sha256:c", "sha256:d")), "00003.parquet"),
    (manifest(cache_id="c1"), "cache_id c1"),
    (manifest(status="incomplete"), "'incomplete'"),
])
def test_a_cache_unlike_the_reference_is_refused_naming_what_differs(got, named):
    bench.check_same_cache(manifest(), manifest(), "same")  # the reference's own copy passes
    with pytest.raises(AssertionError, match=named):
        bench.check_same_cache(got, manifest(), "tiny at 2 processes vs 1")


def test_too_few_shards_for_the_largest_world_size_is_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="make 7 shards; 2 processes need at least 8"):
        bench.main(["--device", "cpu", "--shapes", "tiny", "--gpus", "1,2", "--sequences", "13", "--shard-size", "2",
                    "--work", str(tmp_path / "work"), "--results", str(tmp_path / "r.jsonl")])
    assert not (tmp_path / "work").exists() and not (tmp_path / "r.jsonl").exists()


@pytest.mark.slow  # 60 s alone, up to 2 min beside CI, on 2 shared cores: three torchrun launches of cache-teacher
def test_tiny_cpu_run_appends_one_row_per_world_size_with_the_same_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    results = tmp_path / "results.jsonl"
    rows = bench.main(["--device", "cpu", "--shapes", "tiny", "--gpus", "1,2", "--seq-len", "32", "--sequences", "16",
                       "--shard-size", "2", "--work", str(tmp_path / "work"), "--results", str(results)])
    assert [json.loads(line) for line in results.read_text().splitlines()] == rows
    assert [row["id"] for row in rows] == ["capture_scaling/tiny/gpus1@abc1234", "capture_scaling/tiny/gpus2@abc1234"]
    one, two = (row["figures"] for row in rows)
    for figures, n in ((one, 1), (two, 2)):
        assert figures["tokens"] == 16 * 32 and figures["shards"] == 8
        assert len(figures["teacher_s_per_rank"]) == n  # every rank printed its own summary
        assert 0 < figures["build_s"] < figures["wall_s"]
        assert figures["tok_per_s"] == pytest.approx(figures["tokens"] / figures["build_s"])
    assert one["cache_id"] == two["cache_id"]
    assert one["scaling"] == 1.0 and two["scaling"] == pytest.approx(two["tok_per_s"] / (2 * one["tok_per_s"]))
    assert rows[1]["config"]["world_size"] == 2 and rows[1]["config"]["reference_world_size"] == 1
    assert not (tmp_path / "work" / "tiny").exists()  # teacher, corpus and caches removed
