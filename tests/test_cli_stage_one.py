"""The stage-one commands (cache-teacher, cache-stats, verify, import-gguf) as a user meets them:
one `error:` line naming the option for every mistake, found before the slow work, and a damaged
cache repaired by rerunning. A tiny random Llama with the real teacher's tokenizer keeps it fast."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cli_helpers import one_error_line, run_cli, run_cli_ok

SMALL = ["--max-sequences", "4", "--seq-len", "32", "-k", "8", "--shard-size", "2", "-q"]


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory, tiny_teacher) -> Path:
    out = tmp_path_factory.mktemp("cli1") / "cache"
    old_mask = os.umask(0o027)
    try:
        run_cli_ok(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL])
    finally:
        os.umask(old_mask)
    return out


@pytest.fixture
def no_slow_work(monkeypatch):
    """Fail if the corpus is tokenised or the teacher loaded: the mistake must be found before."""
    import pipelines.stage_one
    import teacher_cache.backends

    def refuse(*args, **kwargs):
        raise AssertionError("slow work started before the mistake was reported")

    monkeypatch.setattr(pipelines.stage_one, "prepare_corpus", refuse)
    monkeypatch.setattr(teacher_cache.backends, "make_backend", refuse)


def _args(teacher: Path, out: Path, *extra) -> list:
    return ["cache-teacher", "--model", teacher, "--out", out, *SMALL, *extra]


def _shards(cache: Path) -> list[tuple[str, str]]:
    return [(s["name"], s["checksum"]) for s in json.loads((cache / "manifest.json").read_text())["shards"]]


# --- the cache a user gets ---


def test_cache_files_are_readable_as_the_umask_says(tiny_cache):
    """Shared caches: manifest.json and stage_one_config.json are not 0600 beside 0644 shards."""
    files = [p for p in tiny_cache.rglob("*") if p.is_file()]
    assert {"manifest.json", "stage_one_config.json", "LOCK"} <= {p.name for p in files}
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o640"}


def test_rerun_checks_the_shards_without_loading_the_teacher(tiny_cache, tiny_teacher, capsys, monkeypatch):
    import teacher_cache.backends

    monkeypatch.setattr(teacher_cache.backends, "make_backend", lambda *a, **k: pytest.fail("teacher loaded"))
    code, out, _ = run_cli(_args(tiny_teacher, tiny_cache), capsys)
    assert code == 0 and "already complete (every shard checked)" in out


def test_a_shared_cache_this_user_cannot_write_is_reused(tiny_cache, tiny_teacher, tmp_path, capsys, monkeypatch):
    """Another user's complete cache (no write permission here): reused, not refused for its lock;
    damaged, it is one error line instead of a repair. (os.access stands in for the permissions,
    which root ignores.)"""
    import teacher_cache.backends

    cache = tmp_path / "shared"
    shutil.copytree(tiny_cache, cache)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real_access(p, mode) and not (Path(p) == cache and mode & os.W_OK))
    monkeypatch.setattr(teacher_cache.backends, "make_backend", lambda *a, **k: pytest.fail("teacher loaded"))
    code, out, err = run_cli(_args(tiny_teacher, cache), capsys)
    assert code == 0 and "already complete" in out, err
    (cache / "shards" / "00000.parquet").unlink()
    line = one_error_line(*run_cli(_args(tiny_teacher, cache), capsys)[::2])
    assert line.startswith("error: --out ") and "you cannot write to it" in line


def test_damaged_shards_are_repaired_by_rerunning(tiny_cache, tiny_teacher, tmp_path, capsys):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    before = _shards(cache)
    victim = cache / "shards" / "00001.parquet"
    victim.write_bytes(victim.read_bytes()[:-10])
    code, _, err = run_cli(["verify", cache], capsys)
    line = one_error_line(code, err)
    assert "00001.parquet" in line and "rerun `distill cache-teacher` with the options that built" in line
    code, out, _ = run_cli(_args(tiny_teacher, cache), capsys)
    assert code == 0 and "repaired: rebuilt 1 damaged shard(s) (00001.parquet)" in out, out
    assert _shards(cache) == before  # the same bytes as the first build
    code, out, _ = run_cli(["verify", cache], capsys)
    assert code == 0 and " ok: 2 shards" in out
    (cache / "shards" / "00000.parquet").unlink()  # a deleted shard too
    code, out, _ = run_cli(_args(tiny_teacher, cache), capsys)
    assert code == 0 and "(00000.parquet)" in out and _shards(cache) == before


def test_the_loading_bars_of_transformers_stay_out_of_the_output(tiny_teacher, tmp_path, capsys):
    """cache-teacher shows its own progress (none with -q), never transformers' "Loading weights" bar."""
    loud = [a for a in _args(tiny_teacher, tmp_path / "loud") if a != "-q"]
    code, _, err = run_cli(loud, capsys)
    assert code == 0 and "Loading weights" not in err and "%|" in err, err  # our bars, not theirs
    code, _, err = run_cli(_args(tiny_teacher, tmp_path / "quiet"), capsys)
    assert code == 0 and "Loading weights" not in err and "%|" not in err, err
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_teacher)  # outside distill the bar shows: the checks above can fail
    assert "Loading weights" in capsys.readouterr().err


def test_binary_files_matched_by_the_glob_are_skipped_and_counted(tiny_teacher, tmp_path, capsys, caplog):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 20, encoding="utf-8")
    (corpus / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4)
    args = _args(tiny_teacher, tmp_path / "c", "--corpus", corpus, "--glob", "*")
    with caplog.at_level("WARNING"):
        code, out, _ = run_cli(args, capsys)
    assert code == 0 and "1 file(s) skipped as not UTF-8 text" in caplog.text and "logo.png" in caplog.text
    source = json.loads((tmp_path / "c" / "manifest.json").read_text())["data"]["source"]
    assert "(text, 2 files matching *)" in source
    code, _, err = run_cli([*_args(tiny_teacher, tmp_path / "d", "--corpus", corpus, "--glob", "*"),
                            "--encoding-errors", "strict"], capsys)
    line = one_error_line(code, err)
    assert line.startswith("error: --encoding-errors is 'strict'") and "logo.png" in line


# --- mistakes: one line, naming the option, before the corpus is tokenised or the teacher loaded ---


@pytest.mark.parametrize(
    "args, start",
    [
        (["--seq-len", "1"], "--seq-len must be an integer >= 2"),
        (["-k", "0"], "-k must be an integer >= 1, got 0"),
        (["-k", "60000"], "-k must be in [1, vocab_size=49152]"),
        (["--format", "xml"], "--format must be one of 'auto', 'text'"),
        (["--codec", "zip9"], "--codec must be one of"),
        (["--storage", "hdf5"], "--storage must be one of 'parquet', 'zarr', got 'hdf5'"),
        (["--backend", "onnx"], "--backend must be one of 'hf', 'vllm', got 'onnx'"),
        (["--dtype", "int4"], "--dtype must be one of"),
        (["--device", "gpu"], "--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
        (["--temperature", "0"], "--temperature must be a finite number > 0"),
        (["--shard-size", "0"], "--shard-size must be an integer >= 1"),
        (["--encoding-errors", "latin1"], "--encoding-errors must be one of 'skip'"),
        (["--corpus", "/no/such/place"], "--corpus names /no/such/place, which does not exist"),
        (["--model", "/no/such/model"], "--model must be an HF model folder"),
        (["--targets", "random"], "--targets must be one of 'topk', 'sampled', 'topk+sampled', got 'random'"),
        (["--targets", "sampled", "--backend", "vllm"], "--backend must be hf with --targets sampled"),
        (["--targets", "topk+sampled", "--backend", "vllm"], "--backend must be hf with --targets topk+sampled"),
        (["--targets", "topk+sampled", "-k", "49000", "--samples", "200"],
         "--samples plus --k=49000 must be at most vocab_size=49152"),
        (["--samples", "0"], "--samples must be an integer in [1, 255]"),
        (["--samples", "256"], "--samples must be an integer in [1, 255] (counts are uint8), got 256"),
        (["--proposal-temperature", "0"], "--proposal-temperature must be a finite number > 0"),
        (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    ],
)
def test_bad_option_names_the_option(args, start, tiny_teacher, tmp_path, capsys, no_slow_work):
    model = [] if "--model" in args else ["--model", tiny_teacher]
    small = [a for a in SMALL if a not in ("-k", "8")]
    code, _, err = run_cli(["cache-teacher", "--out", tmp_path / "c", *model, *small, *args], capsys)
    line = one_error_line(code, err)
    assert line.startswith(f"error: {start}"), line
    assert "Config" not in line and not line.startswith("error: `")
    assert not (tmp_path / "c").exists()  # nothing left behind by a refused run


def test_glob_matching_nothing_names_the_option(tiny_teacher, tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text")
    code, _, err = run_cli(_args(tiny_teacher, tmp_path / "c", "--corpus", tmp_path / "corpus"), capsys)
    assert one_error_line(code, err).startswith("error: --glob '*.py' matches no files under corpus folder")


def test_out_that_cannot_hold_a_cache_is_refused_in_words(tiny_teacher, tmp_path, capsys, no_slow_work):
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(_args(tiny_teacher, tmp_path / "file"), capsys)
    assert one_error_line(code, err).startswith("error: --out is an existing file")
    code, _, err = run_cli(_args(tiny_teacher, tmp_path / "file" / "cache"), capsys)
    line = one_error_line(code, err)
    assert "is a file, not a folder" in line and "Errno" not in line
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("someone's")
    code, _, err = run_cli(_args(tiny_teacher, tmp_path / "mine"), capsys)
    assert "is not empty (notes.txt" in one_error_line(code, err)


def test_locked_cache_is_refused_before_any_work(tiny_teacher, tmp_path, capsys, no_slow_work):
    from teacher_cache.writer import CacheLock

    lock = CacheLock.acquire(tmp_path / "c")
    try:
        code, _, err = run_cli(_args(tiny_teacher, tmp_path / "c"), capsys)
    finally:
        lock.release()
    assert f"being written by another process (pid {os.getpid()})" in one_error_line(code, err)


def test_another_cache_in_out_is_refused_before_any_work(tiny_cache, tiny_teacher, capsys, no_slow_work):
    before = (tiny_cache / "manifest.json").read_bytes()
    args = [a if a != "8" else "9" for a in _args(tiny_teacher, tiny_cache)]  # -k 9
    line = one_error_line(*run_cli(args, capsys)[::2])
    assert line.startswith(f"error: --out {tiny_cache} holds another cache") and "targets.k: 8 vs 9" in line
    assert (tiny_cache / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("damage", ["empty config", "no weights", "no tokenizer"])
def test_broken_teacher_folder_is_one_error_line(damage, tiny_teacher, tmp_path, capsys, no_slow_work):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    if damage == "empty config":
        (teacher / "config.json").write_text("{}")
        expected = "its config.json is not a model config transformers can read"
    elif damage == "no weights":
        (teacher / "model.safetensors").unlink()
        expected = "has no weight files"
    else:
        for p in teacher.glob("tokenizer*"):
            p.unlink()
        expected = "has no usable tokenizer (no tokenizer files)"
    code, _, err = run_cli(_args(teacher, tmp_path / "c"), capsys)
    line = one_error_line(code, err)
    assert expected in line and str(teacher) in line


def test_every_cache_teacher_option_takes_its_default_and_help_from_its_config_field():
    """Each option that sets a stage-one config field is declared once, on the field
    (distill.configs.option): its names, default and help are the field's, so the CLI and a recipe
    that leaves a key out build the same cache. Only the recipe-only fields have no option."""
    import typer.main

    from distill.cli import app
    from pipelines.stage_one import StageOneConfig

    params = {p.name: p for p in typer.main.get_command(app).commands["cache-teacher"].params}
    fields = {f.name: f for f, _ in StageOneConfig.flat_fields()}
    assert len(fields) == len(StageOneConfig.flat_fields())  # names unique across teacher, corpus, cache
    recipe_only = {"add_eos", "exclude_dirs", "writer_threads"}
    assert set(params) == set(fields) - recipe_only | {"quiet"}
    assert [name for name in recipe_only if "help" in fields[name].metadata] == []
    for name in set(fields) - recipe_only:
        field, param = fields[name], params[name]
        assert field.metadata["help"] and param.help == field.metadata["help"], name
        flags = field.metadata["flags"] or (f"--{name.replace('_', '-')}",)
        if name == "compile":  # unset unless asked: --compile or --no-compile
            assert (param.opts, param.secondary_opts, param.default) == (["--compile"], ["--no-compile"], None)
        elif name == "paths":  # no --corpus: the config's default corpus (CorpusConfig's default_factory)
            assert (param.opts, param.multiple, param.default) == (["--corpus"], True, None)
            assert "default: the Python standard library" in param.help
        elif name == "out":  # CacheConfig has no default out; StageOneConfig's is cache-teacher's
            assert param.opts == ["--out", "-o"] and Path(param.default) == StageOneConfig().cache.out
        else:
            assert param.opts == list(flags) and param.default == field.default, name
    expected = {"paths": "--corpus", "file_glob": "--glob", "value_codec": "--codec", "k": "-k", "format": "--format"}
    assert {name: params[name].opts[0] for name in expected} == expected


def test_options_reach_their_config_fields(tiny_teacher, tmp_path, capsys, monkeypatch):
    """The options named unlike their field (-k, --codec, --glob, --format, repeated --corpus) set
    that field; those not given leave the config's defaults."""
    import pipelines.stage_one
    from pipelines.stage_one import StageOneConfig

    built = []

    def capture(config, progress):
        built.append(config)
        raise SystemExit(0)  # the config is all this test checks

    monkeypatch.setattr(pipelines.stage_one, "cache_teacher", capture)
    (tmp_path / "a").mkdir()
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n')
    args = ["cache-teacher", "--model", tiny_teacher, "-o", tmp_path / "c", "-k", "7", "--codec", "bf16",
            "--glob", "*.txt", "--format", "jsonl", "--corpus", tmp_path / "a", "--corpus", tmp_path / "b.jsonl", "-q"]
    assert run_cli(args, capsys)[0] == 0
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "-q"], capsys)
    assert code == 0, err
    given, default = built
    assert (given.cache.k, given.cache.value_codec) == (7, "bf16")
    assert (given.corpus.file_glob, given.corpus.format) == ("*.txt", "jsonl")
    assert given.corpus.paths == (tmp_path / "a", tmp_path / "b.jsonl") and given.cache.out == tmp_path / "c"
    expected = StageOneConfig(teacher=default.teacher)
    assert (default.corpus, default.cache) == (expected.corpus, expected.cache)


# --- cache-stats, verify, import-gguf ---


def test_plot_file_names(tiny_cache, tmp_path, capsys):
    code, _, err = run_cli(["cache-stats", tiny_cache, "--plot", tmp_path / "x.txt"], capsys)
    assert "'.txt' is not an image format" in one_error_line(code, err)
    assert not (tmp_path / "x.txt").exists()
    code, _, err = run_cli(["cache-stats", tiny_cache, "--plot", tmp_path / "noext"], capsys)
    assert code == 0 and f"wrote {tmp_path / 'noext.png'}" in err
    assert (tmp_path / "noext.png").stat().st_size > 1000
    code, _, err = run_cli(["cache-stats", tiny_cache, "--plot", tmp_path / "no" / "dir.png"], capsys)
    assert "does not exist" in one_error_line(code, err)


def test_import_gguf_to_a_file_is_one_error_line(tmp_path, capsys):
    from pipelines.defaults import default_teacher_gguf

    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(["import-gguf", default_teacher_gguf(), tmp_path / "file"], capsys)
    assert "is an existing file" in one_error_line(code, err)


@pytest.mark.parametrize("flags, expected", [([], None), (["--compile"], True), (["--no-compile"], False)])
def test_compile_reaches_the_hf_backend_unset_unless_asked(tiny_teacher, tmp_path, capsys, monkeypatch, flags, expected):
    """Without a flag the hf backend gets compile=None and decides by its device (compiled on a GPU)."""
    import teacher_cache.backends

    seen = {}

    def fake_backend(name, model_dir, **kwargs):
        seen.update(kwargs, name=name)
        raise SystemExit(0)  # the plumbing is all this test checks; no teacher is loaded

    monkeypatch.setattr(teacher_cache.backends, "make_backend", fake_backend)
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", tmp_path / "c", *SMALL, *flags], capsys)
    assert code == 0, err
    assert seen["name"] == "hf" and seen["compile"] is expected


def test_compile_with_vllm_is_refused(tiny_teacher, tmp_path, capsys, no_slow_work):
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", tmp_path / "c", *SMALL,
                            "--backend", "vllm", "--compile"], capsys)
    assert "--compile" in one_error_line(code, err) and "vllm" in err
