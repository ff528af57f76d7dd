"""Training from several caches at once (--cache A --cache B --cache-weights): each cache's held-out
evaluation beside their mean, the caches' shares in the batches, an exact resume after kill -9, and
the mistakes refused in one line before any work."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from cli_helpers import one_error_line, run_cli
from student.model import Student
from student.trainer import train
from test_cache_synth import make_corpus, write_cache
from test_trainer import KILLED, VOCAB, _train_in_subprocess, config, rows, tiny, tokenizer_hash  # noqa: F401


@pytest.fixture(scope="module")
def second(tiny, tmp_path_factory):  # noqa: F811
    """Another cache of the tiny student's tokenizer: 15 sequences of another corpus."""
    path = tmp_path_factory.mktemp("second") / "cache"
    write_cache(path, make_corpus(num_seqs=15, seq_len=20, k=8, vocab=VOCAB, seed=7),
                tokenizer__hash=tokenizer_hash(tiny[0]), shard_size=4, fmt="parquet")
    return path


def two(tiny, second, out, **overrides):  # noqa: F811
    return config(tiny, out, cache=[str(tiny[1]), str(second)], cache_weights="0.7,0.3", **overrides)


def test_two_caches_train_with_each_caches_evaluation_beside_their_mean(tiny, second, tmp_path):  # noqa: F811
    report = train(two(tiny, second, tmp_path / "run"), progress=False)
    out = Path(report.run_dir)
    evals, per_cache = rows(out, "eval"), rows(out, "cache_eval")
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert [(r["step"], r["cache"]) for r in per_cache] == [(s, c) for s in (0, 3, 6) for c in (0, 1)]
    for row in evals:  # the run's figures are the caches' at the weights
        a, b = (r for r in per_cache if r["step"] == row["step"])
        assert row["kl"] == pytest.approx(0.7 * a["kl"] + 0.3 * b["kl"])
        assert row["ce"] == pytest.approx(0.7 * a["ce"] + 0.3 * b["ce"]) and row["tokens"] == a["tokens"] + b["tokens"]
    assert per_cache[-2]["kl"] != per_cache[-1]["kl"]  # two held-out sets, two numbers
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["cache"] == [str(tiny[1]), str(second)] and run["config"]["cache_weights"] == [0.7, 0.3]
    assert len(run["cache_ids"]) == 2 and run["cache_ids"][0] == run["cache_id"]
    saved = json.loads((out / "eval.json").read_text())
    assert [c["weight"] for c in saved["caches"]] == [0.7, 0.3]
    assert [c["final"]["kl"] for c in saved["caches"]] == [per_cache[-2]["kl"], per_cache[-1]["kl"]]
    assert [path for path, _, _ in report.cache_evals] == [str(tiny[1]), str(second)]


def test_one_cache_listed_alone_is_todays_run(tiny, tmp_path):  # noqa: F811
    """--cache given once (as a list of one) trains exactly as before: no mixture, the same losses."""
    a = train(config(tiny, tmp_path / "a"), progress=False)
    b = train(config(tiny, tmp_path / "b", cache=[str(tiny[1])]), progress=False)
    assert [r["loss"] for r in rows(a.run_dir)] == [r["loss"] for r in rows(b.run_dir)]
    assert not rows(b.run_dir, "cache_eval") and "cache_ids" not in json.loads(Path(b.run_dir, "run.json").read_text())


def test_a_killed_two_cache_run_resumes_to_the_same_losses_bit_for_bit(tiny, second, tmp_path):  # noqa: F811
    kw = dict(steps=8, grad_accum=2, save_every=4, eval_every=4)
    clean = train(two(tiny, second, tmp_path / "clean", **kw), progress=False)
    cfg = two(tiny, second, tmp_path / "killed", **kw)
    assert _train_in_subprocess(cfg, exit_after=5) == KILLED
    assert _train_in_subprocess(cfg) == 0
    keys = ("step", "loss", "kl", "lr", "grad_norm", "tokens", "epoch")
    assert [{k: r[k] for k in keys} for r in rows(cfg.out)] == [{k: r[k] for k in keys} for r in rows(clean.run_dir)]
    assert rows(cfg.out, "cache_eval") == rows(clean.run_dir, "cache_eval")
    a = Student.from_pretrained(Path(clean.student_dir)).state_dict()
    b = Student.from_pretrained(Path(cfg.out) / "student").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_other_weights_make_another_run(tiny, second, tmp_path):  # noqa: F811
    from student.checkpoint import RunDirError

    train(two(tiny, second, tmp_path / "run", steps=2), progress=False)
    with pytest.raises(RunDirError, match="cache_weights"):
        train(two(tiny, second, tmp_path / "run", steps=4).with_flat(cache_weights="0.5,0.5"), progress=False)


def cli(tiny, out, *caches, extra=()):  # noqa: F811
    args = ["train-student", "--student", tiny[0], "--out", out, "--device", "cpu", "--steps", "1", "--heldout", "2"]
    for cache in caches:
        args += ["--cache", cache]
    return args + list(extra)


@pytest.mark.parametrize("weights, match", [("0.5", "one weight >= 0 per --cache (2)"), ("1,-1", "one weight >= 0"),
                                            ("0,0", "positive"), ("a,b", "numbers separated by commas")])
def test_weights_that_cannot_be_shares_are_one_line_naming_the_option(tiny, second, tmp_path, capsys, weights,
                                                                      match):  # noqa: F811
    code, _, err = run_cli(cli(tiny, tmp_path / "run", tiny[1], second, extra=["--cache-weights", weights]), capsys)
    line = one_error_line(code, err)
    assert "--cache-weights" in line and match in line
    assert not (tmp_path / "run").exists()


def test_caches_of_different_tokenizers_are_refused_before_any_work(tiny, tmp_path, capsys):  # noqa: F811
    other = tmp_path / "other"
    write_cache(other, make_corpus(num_seqs=6, seq_len=12, k=8, vocab=VOCAB, seed=3), tokenizer__hash="not-the-same",
                shard_size=4, fmt="parquet")
    code, _, err = run_cli(cli(tiny, tmp_path / "run", tiny[1], other), capsys)
    line = one_error_line(code, err)
    assert "--cache" in line and "tokenizer hash" in line and str(other) in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_caches_of_another_k_are_refused(tiny, tmp_path, capsys):  # noqa: F811
    other = tmp_path / "k4"
    write_cache(other, make_corpus(num_seqs=6, seq_len=12, k=4, vocab=VOCAB, seed=3), k=4,
                tokenizer__hash=tokenizer_hash(tiny[0]), shard_size=4, fmt="parquet")
    code, _, err = run_cli(cli(tiny, tmp_path / "run", tiny[1], other), capsys)
    assert "k 4" in one_error_line(code, err)


def test_sampled_caches_mix_and_a_top_k_cache_beside_them_is_refused_saying_why(tiny, tmp_path, capsys):  # noqa: F811
    from test_ensemble import write_sampled_cache

    a, b = tmp_path / "s1", tmp_path / "s2"
    write_sampled_cache(a, tiny[2], 8, seed=1, tokenizer__hash=tokenizer_hash(tiny[0]))
    write_sampled_cache(b, make_corpus(num_seqs=15, seq_len=20, k=8, vocab=VOCAB, seed=7), 8, seed=2,
                        tokenizer__hash=tokenizer_hash(tiny[0]), shard_size=4)
    report = train(config(tiny, tmp_path / "run", cache=[str(a), str(b)], cache_weights="0.7,0.3",
                          tail="unnormalized", steps=3), progress=False)
    evals, per_cache = rows(report.run_dir, "eval"), rows(report.run_dir, "cache_eval")
    x, y = (r["kl"] for r in per_cache if r["step"] == evals[-1]["step"])
    assert evals[-1]["kl"] == pytest.approx(0.7 * x + 0.3 * y) and all(math.isfinite(r["loss"]) for r in rows(report.run_dir))
    code, _, err = run_cli(cli(tiny, tmp_path / "mixed", tiny[1], a), capsys)
    line = one_error_line(code, err)
    assert "--cache" in line and "topk" in line and "sampled" in line and "tail mass" in line


# --- ensembles: two teachers' caches of one corpus -------------------------------------------------


@pytest.fixture(scope="module")
def other_teacher(tiny, tmp_path_factory):  # noqa: F811
    """The tiny corpus scored by another teacher (test_ensemble._second_teacher), in another shard layout."""
    from test_ensemble import _second_teacher

    path = tmp_path_factory.mktemp("other_teacher") / "cache"
    write_cache(path, _second_teacher(tiny[2]), tokenizer__hash=tokenizer_hash(tiny[0]), shard_size=3,
                fmt="parquet")
    return path


def test_an_ensemble_trains_on_the_mixture_and_reports_each_teacher(tiny, other_teacher, tmp_path):  # noqa: F811
    cfg = config(tiny, tmp_path / "run", cache=(), ensemble=f"{tiny[1]},{other_teacher}", ensemble_weights="1,3",
                 ensemble_k=12)
    report = train(cfg, progress=False)
    evals, per_teacher = rows(report.run_dir, "eval"), rows(report.run_dir, "cache_eval")
    assert [(r["step"], r["cache"]) for r in per_teacher] == [(s, c) for s in (0, 3, 6) for c in (0, 1)]
    last = {r["cache"]: r for r in per_teacher if r["step"] == 6}
    # the KL to the mixture is the KL to neither teacher, nor their weighted mean (it is no mean of the two)
    assert len({evals[-1]["kl"], last[0]["kl"], last[1]["kl"]}) == 3
    assert evals[-1]["kl"] != pytest.approx(0.25 * last[0]["kl"] + 0.75 * last[1]["kl"])
    assert report.teacher_eval.ce < max(t.ce for _, _, t in report.cache_evals)  # the mixture's own CE, from the cache
    run = json.loads(Path(report.run_dir, "run.json").read_text())
    assert run["config"]["cache"] == [str(tiny[1])] and len(run["cache_ids"]) == 2


def test_an_ensemble_of_sampled_caches_trains_and_reads_as_the_teachers_weighted_kl(tiny, tmp_path):  # noqa: F811
    """Sampled caches of two teachers: the estimate is unbiased for the mixture's gradient and reads as
    sum_i w_i KL(p_i || q) (student/ensemble.py), so the run's KL is the teachers' KLs at the weights."""
    from test_ensemble import _second_teacher, write_sampled_cache

    a, b = tmp_path / "s1", tmp_path / "s2"
    write_sampled_cache(a, tiny[2], 12, seed=1, tokenizer__hash=tokenizer_hash(tiny[0]))
    write_sampled_cache(b, _second_teacher(tiny[2]), 12, seed=2, tokenizer__hash=tokenizer_hash(tiny[0]), shard_size=3)
    report = train(config(tiny, tmp_path / "run", cache=(), ensemble=f"{a},{b}", ensemble_weights="1,3",
                          tail="unnormalized"), progress=False)
    evals, per_teacher = rows(report.run_dir, "eval"), rows(report.run_dir, "cache_eval")
    assert all(math.isfinite(r["loss"]) for r in rows(report.run_dir))
    for row in evals:
        x, y = (r["kl"] for r in per_teacher if r["step"] == row["step"])
        assert row["kl"] == pytest.approx(0.25 * x + 0.75 * y, rel=1e-4)
    assert evals[-1]["kl"] < evals[0]["kl"]


@pytest.mark.parametrize("flags, match", [(["--ensemble", "A"], "two caches or more"),
                                          (["--ensemble", "A,B", "--cache", "C"], "given with --cache"),
                                          (["--ensemble", "A,B", "--ensemble-weights", "1"], "one weight >= 0 per --ensemble (2)")])
def test_ensemble_options_that_cannot_work_are_one_line(tiny, tmp_path, capsys, flags, match):  # noqa: F811
    code, _, err = run_cli(cli(tiny, tmp_path / "run", extra=flags), capsys)
    assert match in one_error_line(code, err)


def test_an_ensemble_of_another_corpus_names_the_fingerprint(tiny, second, tmp_path, capsys):  # noqa: F811
    code, _, err = run_cli(cli(tiny, tmp_path / "run", extra=["--ensemble", f"{tiny[1]},{second}"]), capsys)
    line = one_error_line(code, err)
    assert "--ensemble" in line and "data fingerprint" in line and "first differing sequence 0" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_runs_lists_a_mixtures_evaluation_by_cache(tiny, second, tmp_path):  # noqa: F811
    from pipelines.experiments import find_runs, runs_table

    train(two(tiny, second, tmp_path / "mix", steps=2), progress=False)
    train(config(tiny, tmp_path / "one", steps=2), progress=False)
    runs = find_runs([tmp_path])
    mix = next(r for r in runs if r.name == "mix")
    assert mix.cache_id.count("+") == 1 and [e["cache"] for e in mix.cache_evals] == [0, 1]
    table = runs_table(runs)
    assert "mix by cache:" in table and f"{Path(second).name}: KL" in table and "one by cache" not in table


def test_an_ensemble_of_relative_paths_trains(tiny, other_teacher, tmp_path, monkeypatch):  # noqa: F811
    """--ensemble's paths are made absolute with the rest (a relative one stays the run's first cache)."""
    monkeypatch.chdir(Path(tiny[1]).parent)
    relative = f"{Path(tiny[1]).name},{os.path.relpath(other_teacher)}"
    report = train(config(tiny, tmp_path / "run", cache=(), ensemble=relative, steps=2), progress=False)
    assert json.loads(Path(report.run_dir, "run.json").read_text())["config"]["cache"] == [str(tiny[1])]


def test_eval_of_a_mixture_run_evaluates_its_first_cache_without_the_mixtures_step_0_row(tiny, second, tmp_path):  # noqa: F811
    from student.evaluate import evaluate_run_or_folder

    report = train(two(tiny, second, tmp_path / "run", steps=2), progress=False)
    results = evaluate_run_or_folder(report.run_dir, device="cpu")
    assert results.get("before") is None
    assert results["after"].kl == pytest.approx(report.cache_evals[0][1].kl, rel=1e-5)
