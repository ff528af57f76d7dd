"""On-policy rounds (pipelines/rounds.py) from a recipe's [rounds]: two rounds of generate -> score
-> train on a tiny teacher (a random Llama over the real tokenizer), every round's corpus, cache
and run kept; a process killed after any stage and rerun ends where an uninterrupted one does, bit
for bit; the shipped recipe and bad [rounds] keys are checked before any work."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_helpers import run_cli
from test_cli import assert_one_line_error
from pipelines.recipe import builtin_recipe, load_recipe
from pipelines.rounds import mixture_weights, round_paths

REPO = Path(__file__).resolve().parents[1]
RECIPE = """
name = "tiny-rounds"
[teacher]
model = "{teacher}"
[corpus]
seq_len = 32
max_sequences = 8
[cache]
out = "{root}/cache"
k = 8
shard_size = 4
[student]
from = "teacher"
num_layers = 1
[train]
out = "{root}/runs"
steps = 3
batch_size = 2
heldout = 2
eval_every = 3
save_every = 2
log_every = 1
device = "cpu"
[rounds]
count = 2
max_prompts = 3
prompt_tokens = 8
samples_per_prompt = 2
max_new_tokens = 5
steps = 2
static_weight = 0.5
"""


def write(root: Path, teacher, text=RECIPE) -> Path:
    path = root / "rounds.toml"
    path.write_text(text.format(root=root, teacher=teacher))
    return path


def run(path: Path, kill_at: tuple[int, str] | None = None) -> int:
    """`run_recipe` in a child process, killed (SIGKILL) right after the stage `kill_at` completes."""
    script = ("import os, signal, sys\n"
              "from pipelines.recipe import load_recipe, run_recipe\n"
              f"kill = {kill_at!r}\n"
              "stop = lambda r, s: os.kill(os.getpid(), signal.SIGKILL) if (r, s) == kill else None\n"
              f"run_recipe(load_recipe({str(path)!r}), progress=False, on_stage=stop)\n")
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=600).returncode


def weights(run_dir: Path) -> dict:
    from student.model import Student

    return Student.from_pretrained(run_dir / "student").state_dict()


@pytest.fixture(scope="module")
def clean(tiny_teacher, tmp_path_factory):
    root = tmp_path_factory.mktemp("rounds")
    assert run(write(root, tiny_teacher)) == 0
    return root


def test_two_rounds_keep_every_corpus_cache_and_run(clean):
    for r in (1, 2):
        paths = round_paths(clean / "runs", r)
        gen = json.loads((paths.generated / "generation.json").read_text())
        # round 1 samples from the recipe's student, round 2 from round 1's, each with its own seed
        assert gen["policy"]["run"] == str((clean / "runs" if r == 1 else round_paths(clean / "runs", 1).run).resolve())
        assert gen["seed"] == r - 1 and gen["prompts"]["count"] == 3
        cache = json.loads((paths.cache / "manifest.json").read_text())
        assert cache["data"]["generated"]["policy"]["weights_hash"] == gen["policy"]["weights_hash"]
        run = json.loads((paths.run / "run.json").read_text())["config"]
        assert run["cache"] == [str(clean / "cache")] + [str(round_paths(clean / "runs", i).cache) for i in range(1, r + 1)]
        assert run["cache_weights"] == pytest.approx(mixture_weights(1, 0.5, r))
        assert run["objective"] == "reverse_kl" and run["steps"] == 2 and (paths.run / "student").is_dir()
    assert mixture_weights(1, 0.5, 2) == [0.5, 0.25, 0.25]


@pytest.mark.parametrize("kills", [[(1, "score")], [(1, "generate"), (2, "train")]])
def test_a_kill_after_any_stage_resumes_to_the_uninterrupted_rounds(clean, tiny_teacher, tmp_path, kills):
    path = write(tmp_path, tiny_teacher)
    for stage in kills:
        assert run(path, stage) == -signal.SIGKILL
    assert run(path) == 0
    final = round_paths(tmp_path / "runs", 2).run
    want, got = weights(round_paths(clean / "runs", 2).run), weights(final)
    assert all(torch.equal(want[k], got[k]) for k in want)
    read = lambda root: (round_paths(root / "runs", 2).generated / "shard-00000.jsonl").read_bytes()
    assert read(tmp_path) == read(clean)


def test_the_shipped_rounds_recipe_parses():
    recipe = load_recipe(builtin_recipe("rounds"))
    assert recipe.rounds.count == 2 and recipe.rounds.objective == "reverse_kl"


@pytest.mark.parametrize("edit, needles", [
    (lambda t: t.replace("static_weight = 0.5", "static_weight = 1.0"), ["[rounds] static_weight must be in [0, 1)"]),
    (lambda t: t.replace("steps = 2\n", "stepz = 2\n"), ["[rounds]", "unknown key", "stepz"]),
    (lambda t: t + '[sweep]\n"train.lr" = [1e-3, 2e-3]\n', ["[rounds] and [sweep] cannot go together"]),
])
def test_bad_rounds_are_one_line_before_any_work(tiny_teacher, tmp_path, capsys, edit, needles):
    path = write(tmp_path, tiny_teacher, edit(RECIPE))
    code, _, err = run_cli(["run", path], capsys)
    assert_one_line_error(code, err, str(path), *needles)
    assert not (tmp_path / "cache").exists()


def test_rounds_too_small_for_the_held_out_split_are_refused(tiny_teacher, tmp_path, capsys):
    path = write(tmp_path, tiny_teacher, RECIPE.replace("max_prompts = 3", "max_prompts = 1"))
    code, _, err = run_cli(["run", path], capsys)
    assert_one_line_error(code, err, "[rounds] max_prompts x samples_per_prompt (2) must exceed [train] heldout (2)")
