"""The sparse-pages quality benchmark (tests/benchmarks/bench_sparse_pages_quality.py) at a tiny size
on the CPU: real teacher and text, its rows, its two evaluations per run, and its exactness gate.
No figures are claimed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
import bench_sparse_pages_quality as bench  # noqa: E402

SMOKE = ["--seq-len", "96", "--train-seq-len", "80", "--sequences", "3", "--heldout", "1", "--steps", "2", "--eval-every", "1",
         "--num-layers", "2", "--warmup-steps", "1", "--chunk-tokens", "32", "--page-tokens", "16"]


@pytest.mark.slow
def test_tiny_run_checks_then_appends_one_row_per_variant_and_plots(tmp_path, monkeypatch, teacher_dir):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    out, rows_file = tmp_path / "out", tmp_path / "results.jsonl"
    results = bench.main([*SMOKE, "--variants", "whole,dense,sparse:1", "--out", str(out),
                          "--results", str(rows_file)])
    rows = {row["case"]: row for row in map(json.loads, rows_file.read_text().splitlines())}
    assert list(rows) == ["whole", "dense", "sparse_1"]
    assert rows["dense"]["id"] == "sparse_pages_quality/dense@abc1234"
    runs = results["runs"]
    for name, row in rows.items():
        f = row["figures"]
        assert f["steps"] == [0, 1, 2] and len(f["heldout_kl_by_step"]) == 3 and f["seconds"] > 0
        assert f["dense_eval_kl"] == runs[name]["dense_eval"]["kl"] > 0
        assert f["kl_cost_vs_dense"] == pytest.approx(f["dense_eval_kl"] - rows["dense"]["figures"]["dense_eval_kl"])
    assert rows["dense"]["figures"]["kl_cost_vs_dense"] == 0.0
    assert rows["whole"]["figures"]["kl_cost_vs_dense"] == pytest.approx(0.0, abs=1e-4)
    assert runs["sparse_1"]["overrides"]["sparse_pages"] == 1 and "sparse_pages" not in runs["dense"]["overrides"]
    # 80 tokens in chunks of 32 (two pages each) and 16: the last chunk keeps one of its four past
    # pages, so the sparse run's own evaluation (sparse) and the dense evaluation of its student differ.
    sparse = rows["sparse_1"]["figures"]
    assert sparse["heldout_kl"] != pytest.approx(sparse["dense_eval_kl"], rel=1e-4)
    assert (out / "sparse_pages_quality.png").stat().st_size > 0
    assert (out / "cache_L96_n3" / "manifest.json").exists() and results["seq_len"] == 80
    assert all(row["config"]["overrides"]["seq_len"] == 80 for row in rows.values())
    # --resume keeps the finished runs of the same settings (not trained again: the same wall time)
    # and trains the new ones, here two side by side in processes of their own (--jobs 2); the runs
    # keep the order of --variants whatever order they finish in.
    again_rows = tmp_path / "again.jsonl"
    again = bench.main([*SMOKE, "--variants", "dense,sparse:2,sparse:1,sparse:3", "--out", str(out), "--results",
                        str(again_rows), "--resume", "--jobs", "2"])["runs"]
    assert list(again) == ["dense", "sparse_2", "sparse_1", "sparse_3"]
    for name in ("dense", "sparse_1"):
        assert again[name]["seconds"] == runs[name]["seconds"] and again[name]["eval"] == runs[name]["eval"]
        assert "jobs" not in again[name]
    for budget in (2, 3):
        run = again[f"sparse_{budget}"]
        assert run["overrides"]["sparse_pages"] == budget and run["jobs"] == 2 and (out / f"sparse_{budget}").is_dir()
        assert [r["step"] for r in run["eval"]] == [0, 1, 2] and run["dense_eval"]["kl"] > 0
    again_cases = {row["case"]: row["figures"] for row in map(json.loads, again_rows.read_text().splitlines())}
    assert again_cases["sparse_3"]["jobs"] == 2 and "jobs" not in again_cases["dense"]


def _run(root: Path, name: str, losses: list[float], last_kl: float, dense_kl: float) -> dict:
    (root / name).mkdir(parents=True)
    (root / name / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "step": i + 1, "loss": x}) + "\n" for i, x in enumerate(losses)))
    return {"eval": [{"step": len(losses), "kl": last_kl, "ce": 2.0}], "dense_eval": {"kl": dense_kl, "ce": 2.0}}


def test_exactness_gate_passes_equal_runs(tmp_path):
    runs = {"dense": _run(tmp_path, "dense", [3.0, 2.5], 1.5, 1.5), "whole": _run(tmp_path, "whole", [3.0, 2.5], 1.5, 1.5)}
    bench.check_exact({"runs": runs}, tmp_path)


@pytest.mark.parametrize("whole_losses, dense_kl", [([3.0, 2.51], 1.5), ([3.0, 2.5], 1.51)],
                         ids=["whole-losses-differ", "dense-eval-differs"])
def test_exactness_gate_stops_a_chunked_run_that_is_not_exact(tmp_path, whole_losses, dense_kl):
    runs = {"dense": _run(tmp_path, "dense", [3.0, 2.5], 1.5, dense_kl),
            "whole": _run(tmp_path, "whole", whole_losses, 1.5, 1.5)}
    with pytest.raises(AssertionError, match="dense"):
        bench.check_exact({"runs": runs}, tmp_path)


def test_seeds_run_every_variant_per_seed_and_compare_each_with_its_seeds_dense_run():
    assert bench.seeded_specs("dense,sparse:2", None) == "dense,sparse:2"
    assert bench.seeded_specs("dense,sparse:2", "0,1") == "seed0/dense,seed0/sparse:2,seed1/dense,seed1/sparse:2"
    with pytest.raises(SystemExit, match="--seeds"):
        bench.seeded_specs("dense", "0,a")
    run = lambda kl, bpb: {"dense_eval": {"kl": kl, "ce": 0.0, "bits_per_byte": bpb}}
    results = {"runs": {"seed0/dense": run(4.0, 2.0), "seed0/sparse_2": run(4.1, 2.1),
                        "seed1/dense": run(3.0, 1.0), "seed1/sparse_2": run(3.5, 1.0)}}
    summary = bench.summarize(results)
    assert summary["seeds"] == ["seed0", "seed1"]
    assert summary["dense"]["kl"]["mean"] == pytest.approx(3.5) and summary["dense"]["kl"]["std"] == pytest.approx(0.5 ** 0.5)
    kl = summary["cost_vs_dense"]["sparse_2"]["kl"]
    assert kl["values"] == pytest.approx([0.1, 0.5]) and kl["mean"] == pytest.approx(0.3)
    assert kl["within_noise"] is True  # 0.3 <= the dense runs' sd, 0.71
    bpb = summary["cost_vs_dense"]["sparse_2"]["bits_per_byte"]
    assert bpb["mean"] == pytest.approx(0.05) and bpb["within_noise"] is True
    results["runs"]["seed1/sparse_2"] = run(4.5, 1.0)  # 1.5 worse than its seed's dense run
    assert bench.summarize(results)["cost_vs_dense"]["sparse_2"]["kl"]["within_noise"] is False
