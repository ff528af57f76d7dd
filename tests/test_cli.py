"""The `distill` command end to end on the real default teacher and real stdlib text, and the
one-line errors a user gets for every mistake the issue lists."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cli_helpers import one_error_line, run_cli
from distill.cli import app, main
from teacher_cache.writer import CacheWriter
from test_trainer import tiny  # noqa: F401  (the module-scoped fixture: a tiny student and cache)

SMALL = ["--max-sequences", "4", "--seq-len", "48", "-k", "8", "--shard-size", "2", "-q"]


def assert_one_line_error(code, err, *needles):
    line = one_error_line(code, err)
    for needle in needles:
        assert needle in line, line


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory, teacher_dir):
    out = tmp_path_factory.mktemp("cli") / "cache"
    old, sys.argv = sys.argv, ["distill", "cache-teacher", "--out", str(out), *SMALL]
    try:
        main()
    except SystemExit as e:
        assert e.code in (0, None)
    finally:
        sys.argv = old
    return out


def test_cache_teacher_stats_verify(small_cache, capsys, tmp_path):
    code, out, _ = run_cli(["cache-stats", small_cache, "--json"], capsys)
    assert code == 0
    stats = json.loads(out)
    assert stats["sequences"] == 4 and stats["tokens"] == 4 * 48
    # A real pretrained teacher on Python source: perplexity far below uniform over 49,152 tokens.
    assert 1.0 < stats["teacher_perplexity"] < 200
    code, out, _ = run_cli(["cache-stats", small_cache, "--plot", tmp_path / "s.png"], capsys)
    assert code == 0 and "perplexity" in out.lower() and (tmp_path / "s.png").stat().st_size > 1000
    code, out, _ = run_cli(["verify", small_cache], capsys)
    assert code == 0 and "ok" in out.lower()
    resolved = json.loads((small_cache / "stage_one_config.json").read_text())
    assert resolved["cache"]["k"] == 8 and resolved["corpus"]["seq_len"] == 48


def test_rerun_of_complete_cache_does_nothing(small_cache, capsys, monkeypatch):
    import teacher_cache.backends

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher was loaded for a cache that is already complete")

    monkeypatch.setattr(teacher_cache.backends, "make_backend", no_teacher)
    before = (small_cache / "manifest.json").read_bytes()
    code, out, _ = run_cli(["cache-teacher", "--out", small_cache, *SMALL], capsys)
    assert code == 0 and "already complete" in out
    assert (small_cache / "manifest.json").read_bytes() == before


def test_other_cache_in_directory_is_refused_and_kept(small_cache, capsys):
    before = (small_cache / "manifest.json").read_bytes()
    args = ["cache-teacher", "--out", small_cache, *SMALL, "-k", "9"]
    code, _, err = run_cli(args, capsys)
    assert_one_line_error(code, err, "another cache")
    assert (small_cache / "manifest.json").read_bytes() == before


def test_second_writer_is_refused(small_cache, tmp_path, capsys):
    out = tmp_path / "locked"
    spec = json.loads((small_cache / "manifest.json").read_text())
    identity = {key: spec[key] for key in ("teacher", "tokenizer", "data", "targets", "storage")}
    with CacheWriter(out, identity):
        code, _, err = run_cli(["cache-teacher", "--out", out, *SMALL], capsys)
    assert_one_line_error(code, err, "another process")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--corpus", "/no/such/place"], "/no/such/place"),
        (["-k", "0"], "k must be"),
        (["-k", "60000"], "vocab_size=49152"),
        (["--seq-len", "1"], "--seq-len"),
        (["--format", "xml"], "xml"),
        (["--codec", "zip9"], "zip9"),
        (["--storage", "hdf5"], "hdf5"),
        (["--backend", "onnx"], "onnx"),
        (["--model", "/no/such/model"], "/no/such/model"),
    ],
)
def test_cache_teacher_bad_input(args, needle, tmp_path, capsys):
    base = ["--max-sequences", "2", "--seq-len", "32", "-q"]
    code, _, err = run_cli(["cache-teacher", "--out", tmp_path / "c", *base, *args], capsys)
    assert_one_line_error(code, err, needle)


def test_empty_corpus(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(["cache-teacher", "--out", tmp_path / "c", "--corpus", tmp_path / "empty", "-q"], capsys)
    assert_one_line_error(code, err)


def test_corrupt_shard_is_named_by_verify_and_stats(small_cache, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(small_cache, broken)
    victim = sorted((broken / "shards").iterdir())[1]
    files = sorted(p for p in victim.rglob("*") if p.is_file()) if victim.is_dir() else [victim]
    target = max(files, key=lambda p: p.stat().st_size)
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    code, _, err = run_cli(["verify", broken], capsys)
    assert_one_line_error(code, err, victim.name)
    code, _, err = run_cli(["cache-stats", broken], capsys)
    assert_one_line_error(code, err, victim.name)


def test_help_has_examples(capsys):
    for command in ("cache-teacher", "cache-stats", "verify", "import-gguf"):
        code, out, _ = run_cli([command, "--help"], capsys)
        assert code == 0 and "Example" in out, command


# --- train-student and eval (tiny students on the synthetic cache of test_trainer) ---------------


def test_train_student_takes_every_default_from_the_config():
    """Every TrainConfig field is an option of train-student, under its flat name, with the config's
    default: a default is written once (a recipe that leaves a key out trains the same)."""
    import typer.main

    from student.train_config import TrainConfig

    params = {p.name: p for p in typer.main.get_command(app).commands["train-student"].params}
    defaults = TrainConfig.flat_defaults()
    assert set(defaults) | {"cache", "out"} <= set(params)
    given = {name: params[name].default for name in defaults}
    # a list the command line takes as text (--cache-weights 0.7,0.3) is unset there (None), read as []
    assert {n: v for n, v in given.items() if v is not None} == {n: defaults[n] for n in given if given[n] is not None}
    assert all(defaults[n] in (None, []) for n, v in given.items() if v is None)
    run = {"cache": "c", "out": "o", "teacher": "t", "num_layers": 1}
    assert TrainConfig.from_flat(**{**given, **run}).to_flat() == TrainConfig.from_flat(**run).to_flat()
    assert params["out"].required and not params["cache"].required  # --cache, or --ensemble


def test_every_training_option_is_declared_once_on_its_config_field():
    """The options come from the fields (distill.configs.option): each field has its help text there,
    and no option of train-student is declared twice or without help."""
    import typer.main

    from student.train_config import TrainConfig

    fields = TrainConfig.flat_fields()
    assert [f.name for f, _ in fields if not f.metadata.get("help")] == []
    command = typer.main.get_command(app).commands["train-student"]
    names = [opt for p in command.params for opt in p.opts]
    assert len(names) == len(set(names))
    helps = {p.name: p.help for p in command.params}
    assert all(helps[f.name] == f.metadata["help"] for f, _ in fields)


def test_help_of_the_stage_two_commands_has_examples(capsys):
    for command in ("train-student", "eval", "run", "quickstart"):
        code, out, _ = run_cli([command, "--help"], capsys)
        assert code == 0 and "Example" in out, command
    import typer.main

    command = typer.main.get_command(app).commands["train-student"]
    options = {opt for p in command.params for opt in [*p.opts, *p.secondary_opts]}
    for option in ("--weight-decay", "--clip-grad", "--min-lr-ratio", "--log-every", "--dtype", "--foam-scale",
                   "--foam-fold-embeddings", "--eval-sequences", "--dead-window", "--tokenizer", "--resume-from",
                   "--chunk-tokens", "--page-tokens", "--kv-offload", "--offload-pages", "--checkpoint-layers",
                   "--sparse-pages"):
        assert option in options, option


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--seq-len", "1"], ["--seq-len must be an integer >= 2, or leave it out, got 1"]),
        (["--tail", "sideways"], ["--tail must be one of 'bucket', 'renorm', 'unnormalized', got 'sideways'"]),
        (["--dtype", "float16"], ["--dtype must be one of 'auto', 'float32', 'bfloat16', got 'float16'"]),
        (["--optimizer", "sgd"], ["--optimizer must be one of"]),
        (["--dead-reinit", "0.1"], ["--dead-reinit acts on the sparse FFN's gate"]),
        (["--temperature", "2"], ["--temperature is 2 but the cache holds the teacher at temperature 1",
                                  "--tail renorm"]),
        (["--heldout", "24"], ["--heldout must be an integer in [0, 23] (the cache has 24 sequences", "got 24"]),
        (["--steps", "0"], ["--steps must be an integer >= 1, got 0"]),
        (["--chunk-tokens", "8", "--page-tokens", "48"], ["--page-tokens must be a power of two >= 16, got 48"]),
        (["--kv-offload"], ["--kv-offload keeps the pages of chunk-recurrent training", "--chunk-tokens"]),
        (["--sparse-pages", "4"], ["--sparse-pages selects past pages", "--chunk-tokens"]),
        (["--chunk-tokens", "0"], ["--chunk-tokens must be a positive integer, or leave it out, got 0"]),
        # inf passes `> 0` and would fail at the first step; nan fails every comparison: both refused up front
        (["--lr", "inf"], ["--lr must be a finite number > 0, got inf"]),
        (["--lr", "nan"], ["--lr must be a finite number > 0, got nan"]),
        (["--weight-decay", "inf"], ["--weight-decay must be a finite number >= 0, got inf"]),
        (["--clip-grad", "inf"], ["--clip-grad must be a finite number >= 0 (0: no clipping), got inf"]),
        (["--optimizer", "foam", "--foam-scale", "inf"], ["--foam-scale must be a finite number > 0, got inf"]),
        (["--sparse-ffn", "--l1", "inf"], ["--l1 must be a finite number >= 0, got inf"]),
        (["--temperature", "inf"], ["--temperature must be a finite number > 0, or leave it out (the cache's), "
                                    "got inf"]),
    ],
)
def test_train_student_errors_name_the_option(tiny, tmp_path, capsys, args, needles):  # noqa: F811
    student, cache, _ = tiny
    code, _, err = run_cli(["train-student", "--cache", cache, "--student", student, "--out", tmp_path / "run",
                            "--device", "cpu", "-q", *args], capsys)
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "run").exists()


def test_train_student_out_that_is_a_file_is_named_in_words(tiny, tmp_path, capsys):  # noqa: F811
    student, cache, _ = tiny
    (tmp_path / "taken").write_text("mine")
    code, _, err = run_cli(["train-student", "--cache", cache, "--student", student, "--out", tmp_path / "taken",
                            "--device", "cpu", "-q"], capsys)
    assert_one_line_error(code, err, "--out is an existing file")
    assert "Errno" not in err and (tmp_path / "taken").read_text() == "mine"


def test_eval_labels_its_kl_a_lower_bound(tiny, tmp_path, capsys):  # noqa: F811
    student, cache, _ = tiny
    out = tmp_path / "run"
    code, stdout, err = run_cli(["train-student", "--cache", cache, "--student", student, "--out", out, "--steps", "1",
                                 "--batch-size", "2", "--heldout", "2", "--device", "cpu", "-q"], capsys)
    assert code == 0, err
    assert "KL (top-k bound)" in stdout and "\nKL is a lower bound of the full-vocabulary KL" in stdout
    assert f"{out}: 1 step; student saved to" in stdout
    code, stdout, _ = run_cli(["eval", out, "--json"], capsys)
    assert code == 0 and json.loads(stdout)["kl_note"].startswith("kl is a lower bound")  # the JSON names its field
    assert "lower bound" in json.loads((out / "eval.json").read_text())["kl_note"]
    code, stdout, err = run_cli(["eval", out, "-q"], capsys)
    assert code == 0 and "run: 1 step, optimizer adamw" in stdout, err
    # The run trained whole sequences; a 0 is refused as train-student refuses it, not taken for "as the run".
    code, _, err = run_cli(["eval", out, "--chunk-tokens", "0"], capsys)
    assert_one_line_error(code, err, "--chunk-tokens must be a positive integer, or leave it out, got 0")


def test_eval_table_keeps_its_columns_at_any_perplexity():
    """An untrained student's perplexity is in the millions: the PPL column keeps its width."""
    from distill.cli import _eval_table
    from student.evaluate import EvalResult

    rows = {"teacher": EvalResult(kl=0.0, ce=2.5, ppl=12.18, top1=1.0, tokens=96),
            "before": EvalResult(kl=14.1, ce=16.2, ppl=11_113_121.9, top1=0.0, tokens=96),
            "after": EvalResult(kl=1.2, ce=3.1, ppl=22.2, top1=0.5, tokens=96)}
    header, *lines = _eval_table(rows).splitlines()[:4]
    assert "1.111e+07" in lines[1] and "12.18" in lines[0]
    assert {len(line) for line in lines} == {len(header)}


def test_eval_usage_names_what_it_takes(capsys):
    code, out, _ = run_cli(["eval", "--help"], capsys)
    assert code == 0 and "run_or_student" in out and "{path}" not in out


def test_ctrl_c_exits_130_and_says_how_to_resume(tiny, tmp_path):  # noqa: F811
    """A real SIGINT to a training process: exit status 130 and the one line saying how to resume
    (typer turns KeyboardInterrupt into a silent exit unless main() carries it past). The child gets
    SIGINT's default disposition: started from a shell's background job (`cmd &` without job
    control) it would inherit SIGINT ignored, and Python then installs no handler."""
    import os
    import signal
    import subprocess
    import time

    student, cache, _ = tiny
    out = tmp_path / "run"
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "distill", "train-student", "--cache", str(cache), "--student", str(student),
         "--out", str(out), "--steps", "100000", "--batch-size", "2", "--heldout", "2", "--device", "cpu",
         "--eval-every", "0", "--save-every", "0", "--log-every", "1", "-q"],
        env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and '"train"' in (out / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()  # a no-op once it has exited; never leave a 100,000-step run behind
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted; run the same command again to resume"
    assert "Traceback" not in err
