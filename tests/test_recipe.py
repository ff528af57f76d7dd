"""Recipes and `distill run` / `distill quickstart` end to end on the real default teacher and real
stdlib text: stage one, a pruned student, training, evaluation, and reuse of a finished cache."""

from __future__ import annotations

import json

import pytest

from pipelines.recipe import builtin_recipe, load_recipe, train_config
from tests.test_cli import assert_one_line_error, run_cli

TINY = """
name = "tiny"
[corpus]
seq_len = 48
max_sequences = 10
[cache]
out = "{root}/cache"
k = 16
shard_size = 4
[student]
from = "teacher"
num_layers = 2
[train]
out = "{root}/run"
steps = 12
batch_size = 2
lr = 2e-3
warmup_steps = 2
heldout = 2
eval_every = 6
save_every = 6
"""


def write_recipe(tmp_path, text=TINY, name="r.toml"):
    path = tmp_path / name
    path.write_text(text.format(root=tmp_path))
    return path


def test_quickstart_recipe_parses():
    recipe = load_recipe(builtin_recipe("quickstart"))
    assert recipe.name == "quickstart" and recipe.student.source == "teacher"
    assert recipe.stage_one.teacher.model is None  # "default": the embedded teacher
    config = train_config(recipe, teacher_dir="/teachers/t")
    assert config.teacher == "/teachers/t" and config.num_layers == recipe.student.num_layers
    assert config.cache == str(recipe.stage_one.cache.out)


@pytest.mark.parametrize(
    "edit, needles",
    [
        (lambda t: t + "\n[optimizer]\nlr = 1\n", ["unknown section", "optimizer"]),
        (lambda t: t.replace("steps = 12", "stepz = 12"), ["unknown key", "stepz", "[train]"]),
        (lambda t: t.replace("seq_len = 48", "seqlen = 48"), ["unknown key", "seqlen", "[corpus]"]),
        (lambda t: t.replace('out = "{root}/cache"', ""), ["[cache] needs out"]),
        (lambda t: t.replace("k = 16", "k = [16"), ["not valid TOML"]),
        (lambda t: t.replace("steps = 12", "steps = 0"), ["`steps` must be"]),
    ],
)
def test_bad_recipes_give_one_line(tmp_path, capsys, edit, needles):
    path = write_recipe(tmp_path, edit(TINY))
    code, _, err = run_cli(["run", path], capsys)
    assert_one_line_error(code, err, *needles)


def test_missing_recipe(tmp_path, capsys):
    code, _, err = run_cli(["run", tmp_path / "nope.toml"], capsys)
    assert_one_line_error(code, err, "does not exist")


def test_run_trains_evaluates_and_reuses_the_cache(tmp_path, capsys, monkeypatch, teacher_dir):
    path = write_recipe(tmp_path)
    code, out, err = run_cli(["run", path, "-q"], capsys)
    assert code == 0, err
    assert "teacher (cache)" in out and "student before" in out and "student after" in out
    ev = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert ev["final"]["kl"] < 0.8 * ev["initial"]["kl"]  # 12 steps on a 2-layer prune: KL falls
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert run["cache_id"] == manifest["cache_id"]

    # Second run of the same recipe: the cache is complete and matching, so the teacher is not
    # loaded; the finished training is not repeated.
    import teacher_cache.backends

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher was loaded although its cache is complete")

    monkeypatch.setattr(teacher_cache.backends, "make_backend", no_teacher)
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    code, out, err = run_cli(["run", path, "-q"], capsys)
    assert code == 0, err
    assert "reused" in out
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before

    code, out, err = run_cli(["eval", tmp_path / "run", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["after"]["kl"] == pytest.approx(ev["final"]["kl"], rel=1e-6)


@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path, capsys, monkeypatch, teacher_dir):
    """The README's main command, as shipped (minutes on a 2-core CPU; its time is in RESULTS.md)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["quickstart", "-q"], capsys)
    assert code == 0, err
    ev = json.loads((tmp_path / "runs" / "quickstart" / "eval.json").read_text())
    assert ev["final"]["kl"] < ev["initial"]["kl"] / 3  # measured: 12.5 -> 2.2 nats/token
    assert ev["final"]["top1"] > 0.15
    assert (tmp_path / "runs" / "quickstart" / "student" / "tokenizer.json").exists()
