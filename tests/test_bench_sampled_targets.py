"""The sampled-vs-top-k benchmark (tests/benchmarks/bench_sampled_targets.py) tiny on the CPU, on a
recipe of the tests' tiny teacher: one row a cache with its figures, the plot, a rerun that reuses
the caches, and the options it refuses. No figures are claimed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_evaluate_teacher import derived

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
import bench_sampled_targets as bench  # noqa: E402


@pytest.fixture()
def tiny_recipe(tiny_teacher, teacher_tokenizer, tmp_path):
    """The quickstart's shape on a tiny teacher (the tests' one with peaked logits) and a student
    folder that is a noisy copy of it, fp32 cache values (so the cache's top-k kl is exactly a
    bound of the full-vocabulary KL)."""
    teacher = derived(tiny_teacher, teacher_tokenizer, tmp_path / "teacher", 0.0, 40.0)
    student = derived(teacher, teacher_tokenizer, tmp_path / "student", 0.1)
    path = tmp_path / "tiny.toml"
    path.write_text(f"""
[teacher]
model = "{teacher}"
dtype = "float32"
[corpus]
seq_len = 32
[cache]
out = "{tmp_path / 'unused-cache'}"
value_codec = "fp32"
shard_size = 4
[student]
from = "{student}"
[train]
out = "{tmp_path / 'unused-run'}"
lr = 1e-2
""")
    return path


@pytest.mark.slow  # about 30 s of CPU: two caches, two trainings, three evaluations with the teacher
def test_tiny_cpu_run_appends_a_row_per_cache_and_plots(tiny_recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_BENCH_COMMIT", "abc1234")
    results, png = tmp_path / "results.jsonl", tmp_path / "st.png"
    argv = ["--recipe", str(tiny_recipe), "--device", "cpu", "--tokens", "256", "--seq-len", "32", "--steps", "2",
            "--batch-size", "2", "--heldout", "2", "--eval-every", "0", "--targets", "topk:4,topk:16",
            "--out", str(tmp_path / "out"), "--results", str(results), "--plot", str(png)]
    rows = bench.main(argv)
    assert [json.loads(line) for line in results.read_text().splitlines()] == rows
    assert [row["id"] for row in rows] == ["sampled_targets/topk4@abc1234", "sampled_targets/topk16@abc1234"]
    small, large = (row["figures"] for row in rows)
    for f, k in ((small, 4), (large, 16)):
        assert f["targets"] == "topk" and f["count"] == k and f["step"] == 2 and f["heldout_tokens"] == 2 * 32
        # the top-k + tail kl is a lower bound of the exact KL (the same fp32 teacher underneath)
        assert 0 < f["cache_kl"] <= f["full_vocab_kl"] and 0 <= f["calibration_error"] <= 1
        assert f["ce"] > 0 and f["teacher_ce"] > 0 and 0 <= f["teacher_calibration_error"] <= 1
        assert "lower bound" in f["kl_note"] and f["cache_reused"] is False
    assert large["bytes_per_token"] > small["bytes_per_token"] > 0
    [cache] = rows[0]["config"]["train_config"]["cache"]
    assert cache.endswith("caches/topk4")
    # equal training: the same steps, seed, batch and held-out split, only the cache differs
    same = lambda row: {k: v for k, v in row["config"]["train_config"].items() if k not in ("cache", "out")}
    assert same(rows[0]) == same(rows[1])
    assert png.stat().st_size > 0

    # A rerun reuses the cache (the teacher does not score again) and re-evaluates the finished run;
    # another seed trains a run of its own from the same cache.
    again = bench.main([*argv, "--targets", "topk:4", "--seeds", "0,1"])
    assert [row["id"] for row in again] == ["sampled_targets/topk4@abc1234#2", "sampled_targets/topk4-seed1@abc1234"]
    assert again[0]["figures"]["cache_reused"] is True and again[1]["figures"]["cache_reused"] is True
    assert again[0]["figures"]["full_vocab_kl"] == pytest.approx(small["full_vocab_kl"], rel=1e-6)
    assert [row["figures"]["seed"] for row in again] == [0, 1]
    assert again[1]["config"]["train_config"]["seed"] == 1
    assert bench.main(["--plot-only", "--results", str(results), "--plot", str(tmp_path / "again.png")]) == []
    assert (tmp_path / "again.png").stat().st_size > 0


@pytest.mark.parametrize("argv, needle", [
    (["--targets", "topk:8,beam:4"], "--targets"),
    (["--targets", "topk:0"], "--targets"),
    (["--targets", "topk:8,topk:8"], "--targets"),
    (["--targets", "hybrid:8"], "--targets"),
    (["--targets", "hybrid:0+12"], "--targets"),
    (["--targets", "hybrid:8+x"], "--targets"),
    (["--tokens", "1024", "--seq-len", "512", "--heldout", "2"], "--heldout"),
    (["--steps", "0"], "--steps"),
    (["--seeds", "0,x"], "--seeds"),
    (["--seeds", "1,1"], "--seeds"),
])
def test_bad_options_are_refused_naming_the_option(argv, needle, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert needle in capsys.readouterr().err


def test_specs_name_their_runs():
    assert bench.parse_target("topk:100") == ("topk100", "topk", 100)
    assert bench.parse_target("sampled:12") == ("sampled12", "sampled", 12)
    assert bench.parse_target("hybrid:8+12") == ("hybrid8+12", "topk+sampled", "8+12")


def test_a_hybrid_spec_builds_a_hybrid_cache_and_plots_as_its_own_series(tmp_path):
    from run_helpers import load_bench_recipe

    args = bench.parse_args(["--targets", "hybrid:8+12", "--out", str(tmp_path)])
    name, kind, count = args.specs[0]
    cache = bench.stage_one_config(load_bench_recipe(None), args, name, kind, count).cache
    assert (cache.targets, cache.k, cache.samples, cache.slots) == ("topk+sampled", 8, 12, 20)
    assert cache.out == tmp_path / "caches" / "hybrid8+12"

    def row(kind, count, seed, kl):
        return {"figures": {"targets": kind, "count": count, "seed": seed, "bytes_per_token": 10.0 + kl,
                            "full_vocab_kl": kl, "calibration_error": 0.01, "teacher_calibration_error": 0.011}}
    rows = [row("topk", 8, 0, 1.0), row("sampled", 12, 0, 0.9), row("topk+sampled", "8+12", 0, 0.8),
            row("topk+sampled", "8+12", 1, 0.6)]
    series = {kind: (name, marker, points) for kind, name, marker, points in bench.plot_series(rows)}
    assert list(series) == ["topk", "sampled", "topk+sampled"]
    name, marker, points = series["topk+sampled"]
    assert name == "top-k + sampled" and marker not in (series["topk"][1], series["sampled"][1])
    assert len(points) == 1 and points[0]["seeds"] == 2 and points[0]["full_vocab_kl"] == pytest.approx(0.7)
    assert bench.count_tag("topk+sampled", "8+12") == "k=8+S=12"
    bench.plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_seed_means_average_each_cache_over_its_seeds():
    row = lambda kind, count, kl, ece: {"targets": kind, "count": count, "bytes_per_token": 10.0 * count,
                                        "full_vocab_kl": kl, "calibration_error": ece}
    means = bench.seed_means([row("topk", 8, 1.0, 0.01), row("topk", 8, 3.0, 0.03), row("sampled", 12, 0.5, 0.02)])
    by = {(m["targets"], m["count"]): m for m in means}
    assert by["topk", 8]["seeds"] == 2 and by["topk", 8]["full_vocab_kl"] == pytest.approx(2.0)
    assert by["topk", 8]["full_vocab_kl_sd"] == pytest.approx(2**0.5) and by["topk", 8]["calibration_error"] == 0.02
    assert by["sampled", 12]["seeds"] == 1 and by["sampled", 12]["calibration_error_sd"] == 0.0


def test_corpus_names_stdlib_and_torch_and_takes_paths(tmp_path):
    import sysconfig

    import torch

    args = bench.parse_args(["--corpus", f"stdlib,torch,{tmp_path}"])
    assert args.corpus_paths == (Path(sysconfig.get_paths()["stdlib"]), Path(torch.__file__).parent, tmp_path)
    assert bench.parse_args([]).corpus_paths is None


def test_the_plot_takes_the_newest_rows_of_the_newest_training_length(tmp_path):
    """A case measured again at another length replaces nothing of the old curve's: the plot draws
    the newest length's cases only, each from its newest row."""
    def row(case, steps, kl):
        return {"id": f"{bench.BENCH}/{case}@x", "bench": bench.BENCH, "case": case, "figures": {"full_vocab_kl": kl},
                "config": {"train_config": {"steps": steps}}}
    results = tmp_path / "results.jsonl"
    rows = [row("topk8", 1500, 1.0), row("topk100", 1500, 0.9), row("topk100", 3000, 0.8), row("sampled12", 3000, 0.7),
            row("sampled12", 3000, 0.6)]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    newest = {r["case"]: r["figures"]["full_vocab_kl"] for r in bench.newest_rows(results)}
    assert newest == {"topk100": 0.8, "sampled12": 0.6}
