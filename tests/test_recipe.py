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
    assert config.cache == (str(recipe.stage_one.cache.out),)


@pytest.mark.parametrize(
    "edit, needles",
    [
        (lambda t: t + "\n[optimizer]\nlr = 1\n", ["unknown section", "optimizer", "[train], [rounds], [sweep]"]),
        (lambda t: t.replace("steps = 12", "stepz = 12"), ["unknown key", "stepz", "[train]"]),
        (lambda t: t.replace("seq_len = 48", "seqlen = 48"), ["unknown key", "seqlen", "[corpus]"]),
        (lambda t: t.replace('out = "{root}/cache"', ""), ["[cache] needs out"]),
        (lambda t: t.replace("k = 16", "k = [16"), ["not valid TOML"]),
        (lambda t: t.replace("steps = 12", "steps = 0"), ["[train] steps must be an integer >= 1, got 0"]),
        # wrong types, in every section, before stage one runs
        (lambda t: t.replace("lr = 2e-3", 'lr = "1e-3"'), ["[train] lr must be a number, got '1e-3'"]),
        (lambda t: t + 'temperature = "2"\n', ["[train] temperature must be a number, or leave it out, got '2'"]),
        # TOML has inf and nan: refused like any value the first step could not take
        (lambda t: t.replace("lr = 2e-3", "lr = inf"), ["[train] lr must be a finite number > 0, got inf"]),
        (lambda t: t + "chunk_tokens = 0\n", ["[train] chunk_tokens must be a positive integer, or leave it out, "
                                              "got 0"]),
        (lambda t: t.replace("num_layers = 2", 'num_layers = "4"'), ["[student] num_layers must be an integer",
                                                                     "got '4'"]),
        (lambda t: t.replace("k = 16", 'k = "64"'), ["[cache] k must be an integer, got '64'"]),
        (lambda t: t.replace("seq_len = 48", 'seq_len = "48"'), ["[corpus] seq_len must be an integer, got '48'"]),
        (lambda t: t.replace('from = "teacher"', "from = 3"), ["[student] from must be a string, got 3"]),
        (lambda t: t + "cache = \"elsewhere\"\n", ["[train] cache is not a [train] key: [cache] out sets it"]),
        (lambda t: t + "tail = \"sideways\"\n", ["[train] tail must be one of 'bucket', 'renorm', 'unnormalized'"]),
        (lambda t: t + "temperature = 2.0\n", ["[train] temperature is 2 but the cache holds the teacher at "
                                                "temperature 1", "--tail renorm"]),
    ],
)
def test_bad_recipes_give_one_line_before_any_work(tmp_path, capsys, monkeypatch, edit, needles):
    import pipelines.stage_one

    def no_stage_one(*args, **kwargs):
        raise AssertionError("stage one ran before the recipe was checked")

    monkeypatch.setattr(pipelines.stage_one, "cache_teacher", no_stage_one)
    path = write_recipe(tmp_path, edit(TINY))
    code, _, err = run_cli(["run", path], capsys)
    assert_one_line_error(code, err, str(path), *needles)


def test_train_section_takes_every_flat_setting_with_the_cli_defaults(tmp_path):
    """[train] keys are TrainConfig's flat names; one left out takes the same default as
    train-student's option (a default is written once, in the config)."""
    from student.trainer import TrainConfig

    config = train_config(load_recipe(write_recipe(tmp_path)), teacher_dir="/t")
    set_here = {"out", "steps", "batch_size", "lr", "warmup_steps", "heldout", "eval_every", "save_every"}
    defaults = TrainConfig.flat_defaults()
    assert {k: v for k, v in config.to_flat().items() if k in defaults and k not in set_here
            and k not in ("teacher", "num_layers")} == {k: v for k, v in defaults.items()
                                                        if k not in set_here and k not in ("teacher", "num_layers")}
    text = TINY + "foam_scale = 0.5\nclip_grad = 0.0\nmin_lr_ratio = 0.0\ndtype = \"float32\"\n"
    config = train_config(load_recipe(write_recipe(tmp_path, text, "all.toml")), teacher_dir="/t")
    assert (config.optim.foam_scale, config.optim.clip_grad, config.schedule.min_lr_ratio, config.dtype) == (
        0.5, 0.0, 0.0, "float32")


def test_missing_recipe(tmp_path, capsys):
    code, _, err = run_cli(["run", tmp_path / "nope.toml"], capsys)
    assert_one_line_error(code, err, "does not exist")


def test_a_stage_one_error_names_the_recipe_key_not_the_option(tmp_path, capsys, teacher_dir):
    """cache-teacher says --out; a recipe says [cache] out (the same ConfigError, named by its surface)."""
    (tmp_path / "cache").write_text("a file where the cache goes")
    code, _, err = run_cli(["run", write_recipe(tmp_path)], capsys)
    assert_one_line_error(code, err, "[cache] out is an existing file")
    assert "--out" not in err and "`out`" not in err


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


MIXTURE = """
name = "mix"
[corpus]
seq_len = 48
max_sequences = 8
[[cache]]
out = "{root}/code"
k = 16
shard_size = 4
[[cache]]
out = "{root}/prose"
k = 16
shard_size = 4
corpus = {{ paths = ["{prose}"], file_glob = "topics.py" }}
[student]
from = "teacher"
num_layers = 2
[train]
out = "{root}/runs"
steps = 4
batch_size = 2
warmup_steps = 1
heldout = 2
eval_every = 4
save_every = 4
[sweep]
"train.cache_weights" = [[0.75, 0.25], [0.0, 1.0]]
"""


def _mixture_recipe(tmp_path, text=MIXTURE):
    import sysconfig

    path = tmp_path / "mix.toml"
    path.write_text(text.format(root=tmp_path, prose=f"{sysconfig.get_paths()['stdlib']}/pydoc_data"))
    return path


def test_a_recipe_of_several_caches_lists_them_and_sweeps_their_weights(tmp_path):
    recipe = load_recipe(_mixture_recipe(tmp_path))
    assert [str(c.cache.out) for c in recipe.caches] == [str(tmp_path / "code"), str(tmp_path / "prose")]
    assert recipe.caches[1].corpus.file_glob == "topics.py" and recipe.caches[0].corpus.file_glob == "*.py"
    assert recipe.caches[1].corpus.seq_len == 48  # the recipe's [corpus], changed only where the entry says
    assert [p.name for p in recipe.points] == ["cache_weights=0.75+0.25", "cache_weights=0.0+1.0"]
    configs = [train_config(p, teacher_dir="/t") for p in recipe.points]
    assert [c.cache for c in configs] == [(str(tmp_path / "code"), str(tmp_path / "prose"))] * 2
    assert [c.cache_weights for c in configs] == [(0.75, 0.25), (0.0, 1.0)]


@pytest.mark.parametrize("edit, needles", [
    (lambda t: t.replace('out = "{root}/prose"', 'out = "{root}/code"'), ["[[cache]] entries share an out"]),
    (lambda t: t.replace('out = "{root}/prose"\n', ""), ["[cache 2] needs out"]),
    (lambda t: t.replace('file_glob = "topics.py"', 'glob = "topics.py"'), ["[cache 2 corpus]", "unknown key", "glob"]),
    (lambda t: t.replace("k = 16\nshard_size = 4\ncorpus", 'k = "16"\nshard_size = 4\ncorpus'),
     ["[cache 2] k must be an integer"]),
    (lambda t: t.replace('"train.cache_weights" = [[0.75, 0.25], [0.0, 1.0]]', '"train.cache_weights" = [[1, 2, 3]]'),
     ["[sweep] point cache_weights=1+2+3", "[train] cache_weights must be one weight >= 0 per --cache (2)"]),
])
def test_a_bad_cache_list_is_one_line_naming_the_entry(tmp_path, capsys, monkeypatch, edit, needles):
    import pipelines.stage_one

    monkeypatch.setattr(pipelines.stage_one, "cache_teacher", lambda *a, **k: pytest.fail("stage one ran"))
    path = _mixture_recipe(tmp_path, edit(MIXTURE))
    code, _, err = run_cli(["run", path, "--dry-run"], capsys)
    assert_one_line_error(code, err, str(path), *needles)


def test_a_mixture_recipe_builds_both_caches_and_trains_every_weighting(tmp_path, capsys, teacher_dir):
    code, out, err = run_cli(["run", _mixture_recipe(tmp_path), "-q"], capsys)
    assert code == 0, err
    assert f"caches {tmp_path / 'code'}, {tmp_path / 'prose'}" in out
    for name, weights in (("cache_weights=0.75+0.25", [0.75, 0.25]), ("cache_weights=0.0+1.0", [0.0, 1.0])):
        run = json.loads((tmp_path / "runs" / name / "run.json").read_text())
        assert run["config"]["cache_weights"] == weights and len(run["cache_ids"]) == 2
        rows = [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        assert sorted({r["cache"] for r in rows if r["kind"] == "cache_eval"}) == [0, 1]
    assert "by cache:" in out
