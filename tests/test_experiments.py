"""Many experiments over one cache: recipe sweeps (expansion, naming, resume), `distill runs` and
`distill compare` on real small CPU runs of the tiny students of test_trainer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distill.errors import DistillUserError
from cli_helpers import one_error_line, run_cli
from pipelines.experiments import find_runs, read_run
from pipelines.recipe import load_recipe, point_name, run_points, train_config
from test_trainer import REPO, config, rows, tiny  # noqa: F401  (tiny: the module-scoped fixture)

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


def sweep_recipe(tmp_path, tiny, sweep='train.lr = [0.01, 0.003]\n"train.optimizer" = ["adamw", "foam"]'):  # noqa: F811
    student, cache, _ = tiny
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP.format(cache=cache, student=student, root=tmp_path, sweep=sweep))
    return path


def test_sweep_expands_the_grid_in_order_named_by_its_settings(tiny, tmp_path):  # noqa: F811
    recipe = load_recipe(sweep_recipe(tmp_path, tiny))
    names = [p.name for p in recipe.points]
    assert names == ["lr=0.01,optimizer=adamw", "lr=0.01,optimizer=foam",
                     "lr=0.003,optimizer=adamw", "lr=0.003,optimizer=foam"]
    configs = [train_config(p, teacher_dir="unused") for p in recipe.points]
    assert [(c.optim.lr, c.optim.optimizer) for c in configs] == [(0.01, "adamw"), (0.01, "foam"),
                                                                  (0.003, "adamw"), (0.003, "foam")]
    assert [Path(c.out) for c in configs] == [tmp_path / "sweep" / n for n in names]
    assert all(c.schedule.steps == 4 and c.cache == (str(tiny[1]),) for c in configs)
    assert recipe.points[1].settings == {"train.lr": 0.01, "train.optimizer": "foam"}
    no_sweep = tmp_path / "plain.toml"  # a recipe without [sweep] is one run, not a sweep of one point
    no_sweep.write_text(sweep_recipe(tmp_path, tiny).read_text().split("[sweep]")[0])
    assert load_recipe(no_sweep).points == []
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
def test_every_sweep_point_is_checked_before_any_work(tiny, tmp_path, sweep, needles):  # noqa: F811
    with pytest.raises(DistillUserError) as e:
        load_recipe(sweep_recipe(tmp_path, tiny, sweep))
    assert all(n in str(e.value) for n in needles), str(e.value)
    assert not (tmp_path / "sweep").exists()


_SWEEP_CHILD = """
import sys
import time
from pipelines.recipe import load_recipe, run_points
run_points(load_recipe(sys.argv[1]), teacher_dir="unused", progress=False)
"""


def test_interrupted_sweep_skips_finished_points_and_resumes_the_killed_one(tiny, tmp_path):  # noqa: F811
    """Point 1 finishes; the sweep is killed (SIGKILL) after step 3 of point 2, with a
    checkpoint at 2; the rerun skips point 1 untouched and resumes point 2 to the losses of an
    uninterrupted run of it."""
    path = sweep_recipe(tmp_path, tiny, 'train.lr = [0.01, 0.003]')
    recipe = load_recipe(path)
    first, second = recipe.points
    one = load_recipe(path)
    one.points = [first]
    assert [r.state for r in run_points(one, "unused", progress=False)] == ["trained"]
    finished_metrics = (tmp_path / "sweep" / first.name / "metrics.jsonl").read_text()
    env = {**os.environ, "PYTHONPATH": f"{REPO}"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "kill_after_step.py"), "3", "-c", _SWEEP_CHILD,
                           str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    killed = tmp_path / "sweep" / second.name
    assert [r["step"] for r in rows(killed)] == [1, 2, 3] and not (killed / "student").exists()
    assert (killed / "run.pid").exists()  # left behind by the kill, naming a dead process
    summary = read_run(killed)
    assert (summary.status, summary.reason, summary.steps_done, summary.checkpoint_step) == \
        ("stopped", "interrupted after step 3; a rerun resumes from step 2", 3, 2)
    results = run_points(recipe, "unused", progress=False)
    assert [(r.name, r.state) for r in results] == [(first.name, "skipped"), (second.name, "resumed")]
    assert (tmp_path / "sweep" / first.name / "metrics.jsonl").read_text() == finished_metrics
    clean = train_config(second, "unused").with_flat(out=str(tmp_path / "clean"))
    from student.trainer import train

    train(clean, progress=False)
    keys = ("step", "loss", "kl", "lr", "grad_norm")
    assert [{k: r[k] for k in keys} for r in rows(killed)] == [{k: r[k] for k in keys} for r in rows(clean.out)]
    assert run_points(recipe, "unused", progress=False)[1].state == "skipped"


def _failing_loss(monkeypatch, at_call: int, failure):
    """Training's `at_call`-th loss fails: `failure` "nan" makes it NaN, an exception is raised."""
    import kernels.fused_topk_kl as kl_module
    import torch

    real, calls = kl_module.fused_topk_kl, {"n": 0}

    def failing(*args, **kwargs):
        loss, kl = real(*args, **kwargs)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == at_call:
                if failure == "nan":
                    return loss * float("nan"), kl
                raise failure
        return loss, kl

    monkeypatch.setattr(kl_module, "fused_topk_kl", failing)
    return lambda: monkeypatch.setattr(kl_module, "fused_topk_kl", real)


@pytest.fixture(scope="module")
def four_runs(tiny, tmp_path_factory):  # noqa: F811
    """Under one folder: two finished runs (lr 1e-2, 3e-3), one stopped by a NaN loss at step 2,
    one interrupted (an exception) after step 1; 2 steps each."""
    from student.trainer import NonFiniteLossError, train

    root = tmp_path_factory.mktemp("runs")
    kw = dict(steps=2, eval_every=1, save_every=1)
    train(config(tiny, root / "a", **kw), progress=False)
    train(config(tiny, root / "b", lr=3e-3, **kw), progress=False)
    with pytest.MonkeyPatch.context() as mp:
        restore = _failing_loss(mp, 2, "nan")
        with pytest.raises(NonFiniteLossError):
            train(config(tiny, root / "nan", **kw), progress=False)
        restore()
        _failing_loss(mp, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            train(config(tiny, root / "cut", **kw), progress=False)
    return root


def test_runs_tells_finished_running_and_stopped_runs_apart(four_runs, capsys):
    root = four_runs
    assert not (root / "cut" / "run.pid").exists()  # the trainer removes it when it raises
    status = lambda: {r.name: (r.status, r.reason, r.steps_done) for r in find_runs([root])}
    assert status() == {"a": ("finished", None, 2), "b": ("finished", None, 2),
                        "nan": ("stopped", "non-finite loss at step 2; a rerun resumes from step 1", 1),
                        "cut": ("stopped", "interrupted after step 1; a rerun resumes from step 1", 1)}
    dead = subprocess.Popen(["true"])
    dead.wait()
    (root / "cut" / "run.pid").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    assert status()["cut"][0] == "stopped"
    (root / "cut" / "run.pid").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    try:
        assert status()["cut"] == ("running", None, 1)
        runs = find_runs([root])
        assert {r.name: r.differs for r in runs}["b"] == {"lr": 3e-3}
        a = {r.name: r for r in runs}["a"]
        assert a.eval["step"] == 2 and a.tok_per_s > 0 and a.optimizer_state_bytes > 0 and a.steps_total == 2
        code, out, _ = run_cli(["runs", root], capsys)
        assert code == 0
        table = out.splitlines()[:5]
        lines = {line.split()[0]: line for line in table[1:]}
        assert table[0].split() == ["run", "steps", "ckpt", "KL", "CE", "top-1", "tok/s", "opt", "MiB", "status"]
        assert lines["nan"].endswith("stopped") and lines["cut"].endswith("running")
        assert "nan: non-finite loss at step 2; a rerun resumes from step 1" in out.splitlines()
        assert "2/2" in lines["a"] and f"{a.eval['kl']:.4f}" in lines["a"] and "lr=" not in table[0]
        settings = out.split("settings that differ:\n")[1].splitlines()
        assert settings[:2] == ["  a    lr=0.01", "  b    lr=0.003"]
        assert f"cache {a.cache_id[:12]} (every run)" in out
        code, out, _ = run_cli(["runs", root, "--json", "--cache", a.cache_id[:8]], capsys)
        assert code == 0 and sorted(r["name"] for r in json.loads(out)) == ["a", "b", "cut", "nan"]
        code, out, _ = run_cli(["runs", root, "--json", "--cache", "nosuchcache"], capsys)
        assert code == 0 and json.loads(out) == []
    finally:
        (root / "cut" / "run.pid").unlink()


def test_a_nan_stopped_run_resumed_with_a_lower_lr_reads_finished(four_runs, tiny, tmp_path):  # noqa: F811
    import shutil

    from student.trainer import train

    run = tmp_path / "nan"
    shutil.copytree(four_runs / "nan", run)
    train(config(tiny, run, steps=2, eval_every=1, save_every=1, lr=1e-3), progress=False)
    assert (read_run(run).status, read_run(run).reason) == ("finished", None)
    assert not [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "stop"]


def test_compare_side_by_side_plots_and_blanks_per_token_columns_of_different_caches(four_runs, tiny, tmp_path,  # noqa: F811
                                                                                       capsys):
    from student.trainer import train
    from test_cache_synth import make_corpus, write_cache
    from test_trainer import VOCAB, tokenizer_hash

    a, b = four_runs / "a", four_runs / "b"
    code, out, _ = run_cli(["compare", a, b], capsys)
    assert code == 0
    header, a_line, b_line = out.splitlines()[:3]
    assert header.split() == ["run", "at", "step", "held-out", "KL", "CE", "PPL", "top-1", "status"]
    assert [a_line.split()[:3], b_line.split()[:3]] == [["a", "2", f"{read_run(a).eval['kl']:.4f}"],
                                                        ["b", "2", f"{read_run(b).eval['kl']:.4f}"]]
    assert out.splitlines()[3:5] == ["settings that differ:", "  a  lr=0.01"]
    code, out, _ = run_cli(["compare", a, b, "--json"], capsys)
    assert [r["differs"] for r in json.loads(out)] == [{"lr": 0.01}, {"lr": 0.003}]
    code, _, err = run_cli(["compare", a, b, four_runs / "nan", "--plot", tmp_path / "cmp"], capsys)
    assert code == 0 and "cmp.png" in err
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    student, _, _ = tiny
    other_cache = tmp_path / "other-cache"
    write_cache(other_cache, make_corpus(num_seqs=12, seq_len=24, k=8, vocab=VOCAB, seed=7),
                tokenizer__hash=tokenizer_hash(student), data__fingerprint="f1", shard_size=4, fmt="parquet")
    other = tmp_path / "other"
    train(config(tiny, other, cache=str(other_cache), steps=1, warmup_steps=1, eval_every=1, save_every=1), progress=False)
    # Over different caches the per-token columns read "-" (tests/test_bits_per_byte.py: bits/byte stays) ...
    code, out, _ = run_cli(["compare", a, other], capsys)
    assert code == 0 and out.splitlines()[1].split()[2:7] == ["2", "-", "-", "-", "-"]
    assert "different caches" in out and "--allow-different-caches" in out
    code, _, err = run_cli(["compare", a, other, "--plot", tmp_path / "other.png"], capsys)  # ... and a plot is refused
    line = one_error_line(code, err)
    assert "different caches" in line and "--allow-different-caches" in line
    code, out, _ = run_cli(["compare", a, other, "--allow-different-caches"], capsys)
    assert code == 0 and out.splitlines()[0].split()[:2] == ["run", "cache"]  # a column once the caches differ
    assert read_run(other).cache_id[:12] in out.splitlines()[2]
    assert out.splitlines()[1].split()[3] == f"{read_run(a).eval['kl']:.4f}"
    code, _, err = run_cli(["compare", a, tmp_path], capsys)
    assert "not a run directory" in one_error_line(code, err)


def test_run_dry_run_lists_the_points_and_what_each_would_do(tiny, tmp_path, capsys):  # noqa: F811
    path = sweep_recipe(tmp_path, tiny, 'train.lr = [0.01, 0.003]')
    (tmp_path / "sweep" / "lr=0.01" / "student").mkdir(parents=True)
    code, out, _ = run_cli(["run", path, "--dry-run"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("lr=0.01 ") and lines[0].endswith("skip (finished)")
    assert lines[1].startswith("lr=0.003 ") and lines[1].endswith("train")
    assert not (tmp_path / "sweep" / "lr=0.003").exists()


def _run_on_another_host(path, *, log_every=10, tokens=1024, tok_per_s=1000.0, metrics_age_s, pid_age_s):
    """A run directory as a trainer on another host leaves it: run.json, a train row, a run.pid naming
    that host and a pid that is not alive here; the two files last written `*_age_s` seconds ago."""
    path.mkdir()
    (path / "run.json").write_text(json.dumps({"cache_id": "c" * 16, "config": {"steps": 100, "log_every": log_every}}))
    (path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 20, "loss": 3.0, "tokens": tokens,
                                                    "tok_per_s": tok_per_s}) + "\n")
    dead = subprocess.Popen(["true"])
    dead.wait()
    (path / "run.pid").write_text(json.dumps({"pid": dead.pid, "host": "node-7-" + socket.gethostname()}))
    now = time.time()
    os.utime(path / "metrics.jsonl", (now - metrics_age_s, now - metrics_age_s))
    os.utime(path / "run.pid", (now - pid_age_s, now - pid_age_s))
    return read_run(path)


def test_a_run_on_another_host_is_not_judged_by_a_pid_it_cannot_see(tmp_path):
    """Its pid is dead here but says nothing: it is running while it writes, counting run.pid (a
    resumed run writes no row for a while) and its own pace (slow steps log rarely); long silent,
    it reads stopped with a reason that says what is known."""
    host = "node-7-" + socket.gethostname()
    fresh = _run_on_another_host(tmp_path / "fresh", metrics_age_s=5, pid_age_s=3600)
    assert (fresh.status, fresh.reason) == ("running", f"on {host}")
    resumed = _run_on_another_host(tmp_path / "resumed", metrics_age_s=7200, pid_age_s=30)
    assert resumed.status == "running"
    # 10 steps of 1024 tokens at 1 token/s: a row every ~2.8 h, so 1 h of quiet is normal for it
    slow = _run_on_another_host(tmp_path / "slow", tok_per_s=1.0, metrics_age_s=3600, pid_age_s=7200)
    assert slow.status == "running"
    silent = _run_on_another_host(tmp_path / "silent", metrics_age_s=7200, pid_age_s=7200)
    assert silent.status == "stopped"
    assert silent.reason.startswith("nothing written for 120 min after step 20") and host in silent.reason
    assert "cannot be checked from here" in silent.reason
    (tmp_path / "silent" / "student").mkdir()  # finished there, its run.pid left behind by a late kill
    assert read_run(tmp_path / "silent").status == "finished"


def test_the_shipped_sweep_learns_from_the_quickstart_cache():
    """pipelines/recipes/sweep_quickstart.toml (the README's sweep) is valid and shares the
    quickstart's teacher, corpus and cache, so it reuses the cache `distill quickstart` built."""
    from pipelines.recipe import builtin_recipe

    sweep, quickstart = load_recipe(builtin_recipe("sweep_quickstart")), load_recipe(builtin_recipe("quickstart"))
    assert sweep.stage_one == quickstart.stage_one and sweep.student == quickstart.student
    assert [p.name for p in sweep.points] == ["lr=0.001,optimizer=adamw", "lr=0.001,optimizer=foam",
                                              "lr=0.003,optimizer=adamw", "lr=0.003,optimizer=foam"]
    configs = [train_config(p, teacher_dir="unused") for p in sweep.points]
    assert {c.cache for c in configs} == {(str(quickstart.stage_one.cache.out),)}
    assert [Path(c.out).parent for c in configs] == [Path("runs/sweep_quickstart")] * 4


# --- where a stopped run resumes (real runs: a kill -9 and a Ctrl-C) ---------------------------


def test_a_run_killed_between_logged_rows_shows_its_checkpoint_not_step_0(tiny, tmp_path, capsys):  # noqa: F811
    """kill -9 at step 6 of 12 with a checkpoint at 4 and a row every 10 steps (so no training row
    yet): the run reads 4/12 (the checkpoint proves four steps; "or later" as rows are sparse) and
    says a rerun resumes from step 4, which the rerun does."""
    from student.trainer import train

    run = config(tiny, tmp_path / "killed", steps=12, save_every=4, log_every=10, eval_every=0, warmup_steps=1)
    args = ["train-student", "--cache", run.cache[0], "--student", run.student, "--out", run.out, "--steps", "12",
            "--save-every", "4", "--log-every", "10", "--eval-every", "0", "--warmup-steps", "1", "--batch-size", "3",
            "--lr", "1e-2", "--heldout", "4", "--seed", "0", "--deterministic", "--device", "cpu", "-q"]
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "kill_after_step.py"), "6", "-m", "distill", *args],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert rows(run.out) == []  # no training row before step 10
    summary = read_run(run.out)
    assert (summary.status, summary.steps_done, summary.checkpoint_step) == ("stopped", 4, 4)
    assert summary.reason == "interrupted after step 4 or later; a rerun resumes from step 4"
    code, out, _ = run_cli(["runs", tmp_path], capsys)
    header, line = out.splitlines()[:2]
    assert line.split()[:3] == ["killed", "4/12", "4"] and header.split()[1:3] == ["steps", "ckpt"]
    assert train(run, progress=False).resumed_from == 4


def test_a_run_stopped_by_ctrl_c_says_the_step_its_rerun_resumes_from(tiny, tmp_path, monkeypatch):  # noqa: F811
    """Ctrl-C in step 11 of 12: 10 steps trained and logged, checkpoints at 4 and 8; the run reads
    "interrupted after step 10; a rerun resumes from step 8", and the rerun resumes from 8."""
    from student.trainer import train

    run = config(tiny, tmp_path / "cut", steps=12, save_every=4, log_every=1, eval_every=0, warmup_steps=1)
    restore = _failing_loss(monkeypatch, 11, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        train(run, progress=False)
    restore()
    assert [r["step"] for r in rows(run.out)][-1] == 10
    summary = read_run(run.out)
    assert (summary.status, summary.steps_done, summary.checkpoint_step) == ("stopped", 10, 8)
    assert summary.reason == "interrupted after step 10; a rerun resumes from step 8"
    report = train(run, progress=False)
    assert report.resumed_from == 8 and [r["step"] for r in rows(run.out)] == list(range(1, 13))
    assert (read_run(run.out).status, read_run(run.out).reason) == ("finished", None)


# --- tables and plots of varied runs -----------------------------------------------------------


def _written_run(path, *, settings: dict, steps=(1, 2), total=2, kept=(2,), finished=True, cache="c" * 16,
                 tok_per_s=42.0, ppl=12.5, log_every=1):
    """A run directory as the trainer leaves it (run.json, metrics.jsonl, checkpoints/, student/),
    written directly: for the tables' layout, many runs with any values in no time."""
    path.mkdir(parents=True)
    config = {"steps": total, "log_every": log_every, "batch_size": 3, "lr": 0.01, "optimizer": "adamw",
              "weight_decay": 0.0, "warmup_steps": None, "min_lr_ratio": 0.1, "foam_level": 2, "foam_scale": 1.0,
              "ce_weight": 0.0, "tail": "bucket", "temperature": None, "out": str(path), "cache": "caches/x",
              **settings}
    (path / "run.json").write_text(json.dumps({"cache_id": cache, "config": config}))
    metrics = [{"kind": "eval", "step": 0, "kl": 3.0, "ce": 5.0, "ppl": ppl, "top1": 0.1, "tokens": 100}]
    for step in steps:
        metrics.append({"kind": "train", "step": step, "loss": 3.0 - 0.1 * step, "kl": 2.9, "lr": 0.01,
                        "grad_norm": 1.0, "tokens": 64, "tok_per_s": tok_per_s, "optimizer_state_bytes": 3 * 2**20})
    if steps:
        metrics.append({"kind": "eval", "step": steps[-1], "kl": 2.5, "ce": 4.5, "ppl": ppl, "top1": 0.2,
                        "tokens": 100})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    for step in kept:
        (path / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
    if finished:
        (path / "student").mkdir()
    return path


def _columns_align(lines: list[str], headers: list[str]):
    """Each right-aligned column's cells end where its header ends, whatever their widths."""
    for header in headers:
        end = lines[0].index(header) + len(header)
        for line in lines[1:]:
            assert line[end - 1] != " " and (len(line) == end or line[end] == " "), (header, line)


VARIED = {  # four runs as a user's experiments leave them: each differs in several long settings
    "baseline": dict(settings={"optimizer": "adamw", "weight_decay": 0.1, "warmup_steps": 100,
                               "min_lr_ratio": 0.1}, tok_per_s=42.0, ppl=11_113_121.9),
    "foam-level-3-scale-0.5": dict(settings={"optimizer": "foam", "foam_level": 3, "foam_scale": 0.5,
                                             "weight_decay": 0.0}, tok_per_s=12_345.6, ppl=9.87),
    "long-warmup": dict(settings={"warmup_steps": 2000, "min_lr_ratio": 0.01, "lr": 3e-4}, total=4000,
                        steps=(1000, 2000, 3000), kept=(3000,), finished=False),
    "ce-only": dict(settings={"ce_weight": 1.0, "tail": "renorm", "temperature": 2.0}, steps=(), kept=(),
                    finished=False, total=8, log_every=10),
}


@pytest.fixture
def varied(tmp_path):
    for name, kw in VARIED.items():
        _written_run(tmp_path / "exp" / name, **kw)
    return tmp_path / "exp"


def test_runs_and_compare_of_varied_runs_fit_a_terminal_and_align(varied, capsys, monkeypatch):
    """Four runs differing in many settings: short labels (directory names), every line within the
    terminal's 100 columns, the settings listed once below, columns aligned whatever the values
    (tokens/s from 42 to 12,346; a perplexity of eleven million)."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run_cli(["runs", varied], capsys)
    assert code == 0 and max(map(len, out.splitlines())) <= 100, out
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[1:5]] == ["baseline", "ce-only", "foam-level-3-scale-0.5", "long-warmup"]
    _columns_align(lines[:5], ["steps", "ckpt", "KL", "CE", "top-1", "tok/s", "MiB"])
    assert lines[2].split()[1:3] == ["0/8", "-"] and lines[4].split()[1:3] == ["3000/4000", "3000"]
    assert ("ce-only: interrupted before any step was logged or saved; no checkpoint: a rerun starts over"
            in " ".join(out.split()))
    assert "long-warmup: interrupted after step 3000; a rerun resumes from step 3000" in " ".join(out.split())
    listed = out.split("settings that differ:\n")[1]
    assert listed.count("foam_level=3") == 1 and "  baseline  " in listed and "lr=0.0003" in listed
    assert "optimizer" not in lines[0]

    code, out, _ = run_cli(["compare", *sorted(varied.iterdir())], capsys)
    assert code == 0 and max(map(len, out.splitlines())) <= 100, out
    lines = out.splitlines()
    _columns_align(lines[:5], ["step", "KL", "CE", "PPL", "top-1"])
    assert "1.111e+07" in lines[1] and "9.87" in lines[3] and lines[2].split()[1:3] == ["0", "3.0000"]


def test_wide_shows_the_differing_settings_as_columns_and_the_shared_ones_below(varied, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    for command in (["runs", varied, "--wide"], ["compare", *sorted(varied.iterdir()), "--wide"]):
        code, out, _ = run_cli(command, capsys)
        assert code == 0
        lines = out.splitlines()
        header = lines[0].split()
        assert {"optimizer", "foam_level", "weight_decay", "ce_weight", "tail"} <= set(header), header
        assert header.count("steps") == 1  # runs: its steps column holds the totals, not a second one
        optimizer = lines[0].index("optimizer")
        assert [line[optimizer:].split()[0] for line in lines[1:5]] == ["adamw", "adamw", "foam", "adamw"]
        _columns_align(lines[:5], ["KL", "CE", "top-1"])
        assert "settings that differ" not in out
        assert any(line.startswith("settings of every run: batch_size=3") for line in lines)


def test_runs_of_one_name_in_two_folders_are_told_apart(tmp_path, capsys):
    for parent, lr in (("x", 0.01), ("y", 0.003)):
        _written_run(tmp_path / parent / "a", settings={"lr": lr})
    code, out, _ = run_cli(["runs", tmp_path], capsys)
    assert [line.split()[0] for line in out.splitlines()[1:3]] == ["x/a", "y/a"]


def test_compare_plot_keeps_the_legend_off_the_panels_and_draws_short_runs(varied, tmp_path, capsys, monkeypatch):
    """The legend sits beside the four panels, overlapping none; a run shorter than its log_every
    (one training row, at its last step) still shows in the loss panels, as a marker."""
    import teacher_cache.stats as stats

    short = _written_run(tmp_path / "short", settings={"optimizer": "adamw", "weight_decay": 0.1, "warmup_steps": 100,
                                                        "min_lr_ratio": 0.1, "log_every": 10}, steps=(8,), total=8,
                         kept=(8,))
    drawn = []
    real = stats.save_figure
    monkeypatch.setattr(stats, "save_figure", lambda fig, path, dpi: drawn.append(fig) or real(fig, path, dpi))
    runs = [*sorted(varied.iterdir()), short]
    code, _, err = run_cli(["compare", *runs, "--plot", tmp_path / "cmp.svg"], capsys)
    assert code == 0 and (tmp_path / "cmp.svg").read_text().startswith("<?xml")
    (fig,) = drawn
    fig.canvas.draw()
    axes = fig.axes
    (legend,) = fig.legends
    assert all(ax.get_legend() is None for ax in axes)
    box = legend.get_window_extent()
    assert not any(box.overlaps(ax.get_window_extent()) for ax in axes)
    assert [t.get_text().split("\n")[0] for t in legend.get_texts()] == \
        ["baseline", "ce-only", "foam-level-3-scale-0.5", "long-warmup", "short"]
    short_line = axes[0].get_lines()[4]
    assert list(short_line.get_xdata()) == [8] and short_line.get_marker() == "o"


@pytest.mark.parametrize("place", ["under a file", "read-only folder"])
def test_compare_plot_to_a_place_that_cannot_be_written_is_one_error_line(varied, tmp_path, capsys, place):
    from test_cache_stats import _unwritable_folder

    if place == "under a file":
        (tmp_path / "somefile").write_text("")
        target = tmp_path / "somefile" / "cmp.png"
    else:
        target = _unwritable_folder(tmp_path) / "cmp.png"
    try:
        code, out, err = run_cli(["compare", *sorted(varied.iterdir()), "--plot", target], capsys)
        line = one_error_line(code, err)
        assert code == 2 and line.startswith(f"error: --plot {target}:"), line
        assert ("is a file, not a folder" if place == "under a file" else "cannot write it") in line
        assert not target.is_file()
    finally:
        (tmp_path / "read-only").exists() and (tmp_path / "read-only").chmod(0o700)
