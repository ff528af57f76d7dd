"""Many experiments over one cache: recipe sweeps (expansion, naming, resume), `distill runs` and
`distill compare` on real small CPU runs of the tiny students of test_trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distill.errors import DistillUserError
from pipelines.recipe import load_recipe, point_name, run_points, train_config
from test_trainer import REPO, config, make_student, rows, tiny  # noqa: F401  (tiny: a fixture)

SWEEP = """
name = "s"
[cache]
out = "{cache}"
[student]
from = "{student}"
[train]
out = "{root}/sweep"
steps = 4
batch_size = 3
lr = 1e-2
warmup_steps = 1
heldout = 4
eval_every = 2
save_every = 2
log_every = 1
deterministic = true
device = "cpu"
[sweep]
{sweep}
"""


def sweep_recipe(tmp_path, tiny, sweep='train.lr = [0.01, 0.003]\n"train.optimizer" = ["adamw", "foam"]'):
    student, cache, _ = tiny
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP.format(cache=cache, student=student, root=tmp_path, sweep=sweep))
    return path


def test_sweep_expands_the_grid_in_order_named_by_its_settings(tiny, tmp_path):
    recipe = load_recipe(sweep_recipe(tmp_path, tiny))
    names = [p.name for p in recipe.points]
    assert names == ["lr=0.01,optimizer=adamw", "lr=0.01,optimizer=foam",
                     "lr=0.003,optimizer=adamw", "lr=0.003,optimizer=foam"]
    configs = [train_config(p, teacher_dir="unused") for p in recipe.points]
    assert [(c.optim.lr, c.optim.optimizer) for c in configs] == [(0.01, "adamw"), (0.01, "foam"),
                                                                  (0.003, "adamw"), (0.003, "foam")]
    assert [Path(c.out) for c in configs] == [tmp_path / "sweep" / n for n in names]
    assert all(c.schedule.steps == 4 and c.cache == str(tiny[1]) for c in configs)
    assert recipe.points[1].settings == {"train.lr": 0.01, "train.optimizer": "foam"}
    assert point_name({"train.num_layers": 4, "student.num_layers": 6, "train.deterministic": True}) == \
        "train.num_layers=4,student.num_layers=6,deterministic=true"


@pytest.mark.parametrize("sweep, needles", [
    ('train.lr = [1e-3, -1.0]', ["[sweep] point lr=-1.0", "[train] lr"]),
    ('train.optimizr = ["adamw"]', ["[sweep] point optimizr=adamw", "unknown key", "optimizr"]),
    ('cache.k = [8, 16]', ["[sweep] key 'cache.k'", "one cache"]),
    ('train.out = ["a", "b"]', ["cannot vary train.out"]),
    ('train.lr = 0.1', ["[sweep] train.lr must be a non-empty list"]),
    ('train.lr = [0.1, 0.1]', ["the same run name"]),
])
def test_every_sweep_point_is_checked_before_any_work(tiny, tmp_path, sweep, needles):
    with pytest.raises(DistillUserError) as e:
        load_recipe(sweep_recipe(tmp_path, tiny, sweep))
    assert all(n in str(e.value) for n in needles), str(e.value)
    assert not (tmp_path / "sweep").exists()


_SWEEP_CHILD = """
import sys
from pipelines.recipe import load_recipe, run_points
run_points(load_recipe(sys.argv[1]), teacher_dir="unused", progress=False)
"""


def test_interrupted_sweep_skips_finished_points_and_resumes_the_killed_one(tiny, tmp_path):
    """Point 1 finishes; the sweep is killed (os._exit, as SIGKILL) after step 3 of point 2, with a
    checkpoint at 2; the rerun skips point 1 untouched and resumes point 2 to the losses of an
    uninterrupted run of it."""
    path = sweep_recipe(tmp_path, tiny, 'train.lr = [0.01, 0.003]')
    recipe = load_recipe(path)
    first, second = recipe.points
    one = load_recipe(path)
    one.points = [first]
    assert [r.state for r in run_points(one, "unused", progress=False)] == ["trained"]
    finished_metrics = (tmp_path / "sweep" / first.name / "metrics.jsonl").read_text()
    env = {**os.environ, "PYTHONPATH": f"{REPO}", "DISTILL_TEST_EXIT_AFTER_STEP": "3"}
    proc = subprocess.run([sys.executable, "-c", _SWEEP_CHILD, str(path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 17, proc.stderr[-2000:]
    killed = tmp_path / "sweep" / second.name
    assert [r["step"] for r in rows(killed)] == [1, 2, 3] and not (killed / "student").exists()
    results = run_points(recipe, "unused", progress=False)
    assert [(r.name, r.state) for r in results] == [(first.name, "skipped"), (second.name, "resumed")]
    assert (tmp_path / "sweep" / first.name / "metrics.jsonl").read_text() == finished_metrics
    clean = train_config(second, "unused").with_flat(out=str(tmp_path / "clean"))
    from student.trainer import train

    train(clean, progress=False)
    keys = ("step", "loss", "kl", "lr", "grad_norm")
    assert [{k: r[k] for k in keys} for r in rows(killed)] == [{k: r[k] for k in keys} for r in rows(clean.out)]
    assert run_points(recipe, "unused", progress=False)[1].state == "skipped"
