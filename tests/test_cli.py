"""The `distill` command end to end on the real default teacher and real stdlib text, and the
one-line errors a user gets for every mistake the issue lists."""

from __future__ import annotations

import json
import sys

import pytest

from distill.cli import main
from teacher_cache.writer import CacheWriter

SMALL = ["--max-sequences", "4", "--seq-len", "48", "-k", "8", "--shard-size", "2", "-q"]


def run_cli(args, capsys):
    """Run `distill ARGS` in-process; returns (exit code, stdout, stderr)."""
    old = sys.argv
    sys.argv = ["distill", *map(str, args)]
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code, err, *needles):
    assert code != 0
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


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
