"""Cross-tokenizer training end to end on the CPU: a cache of the default teacher's tokenizer (a
random 1-layer teacher over its vocabulary, real text) teaches a student with a freshly trained
8K byte-level BPE; a killed run resumes exactly; with the teacher's own tokenizer the forced
cross-tokenizer path gives today's numbers; refusals cost seconds."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from cli_helpers import one_error_line, run_cli, run_cli_ok
from distill.errors import DistillUserError
from student.model import Student
from student.trainer import TrainConfig, train
from test_trainer import KILLED, _train_in_subprocess

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
from bench_cross_tokenizer import train_bpe  # noqa: E402


@pytest.fixture(scope="module")
def text_cache(tmp_path_factory, tiny_teacher):
    """24 sequences of 48 tokens of the standard library's text, with the teacher's tokenizer files."""
    out = tmp_path_factory.mktemp("xtok") / "cache"
    run_cli_ok(["cache-teacher", "--model", tiny_teacher, "--out", out, "--max-sequences", "24", "--seq-len", "48",
                "--shard-size", "6", "-k", "8", "-q"])
    return out


@pytest.fixture(scope="module")
def bpe8k(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe8k") / "tok", 8192, files=200)


def config(cache, teacher, out, **overrides) -> TrainConfig:
    base = dict(cache=str(cache), out=str(out), teacher=str(teacher), num_layers=1, steps=6, batch_size=3, lr=1e-2,
                warmup_steps=2, heldout=4, eval_every=3, save_every=2, log_every=1, seed=0, deterministic=True,
                device="cpu")
    return TrainConfig.from_flat(**{**base, **overrides})


def rows(out, kind="train"):
    return [r for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_a_student_with_its_own_tokenizer_trains_and_resumes_exactly(text_cache, tiny_teacher, bpe8k, tmp_path):
    kw = dict(tokenizer=str(bpe8k), steps=8, grad_accum=2, save_every=4, eval_every=4)
    clean = train(config(text_cache, tiny_teacher, tmp_path / "clean", **kw), progress=False)
    student = Student.from_pretrained(Path(clean.student_dir))
    assert student.config.vocab_size == 8192
    train_rows = rows(tmp_path / "clean")
    assert all(r["loss"] > 0 and r["kl"] > 0 for r in train_rows)
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    evals = rows(tmp_path / "clean", "eval")
    assert all(r["bits_per_byte"] > 0 for r in evals)
    run = json.loads((tmp_path / "clean" / "run.json").read_text())
    assert run["cross_tokenizer"] is True
    eval_json = json.loads((tmp_path / "clean" / "eval.json").read_text())
    counts = eval_json["alignment"]
    assert 0 < counts["aligned"] < counts["positions"]  # a BPE of 8K splits the teacher's tokens
    assert "mapped onto the student's vocabulary" in eval_json["kl_note"]
    # killed after step 5 (checkpoint at 4), resumed: the same numbers and weights
    cfg = config(text_cache, tiny_teacher, tmp_path / "killed", **kw)
    assert _train_in_subprocess(cfg, exit_after=5) == KILLED
    assert _train_in_subprocess(cfg) == 0
    keys = ("step", "loss", "kl", "lr", "grad_norm", "tokens", "epoch")
    assert [{k: r[k] for k in keys} for r in rows(cfg.out)] == [{k: r[k] for k in keys} for r in train_rows]
    assert rows(cfg.out, "eval") == evals
    a, b = student.state_dict(), Student.from_pretrained(Path(cfg.out) / "student").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_teachers_own_tokenizer_through_the_cross_path_gives_todays_numbers(text_cache, tiny_teacher, tmp_path):
    keys = ("step", "loss", "kl", "grad_norm", "tokens")
    plain = config(text_cache, tiny_teacher, tmp_path / "plain", ce_weight=0.25)
    forced = config(text_cache, tiny_teacher, tmp_path / "forced", ce_weight=0.25, cross_tokenizer="byte-prefix")
    train(plain, progress=False), train(forced, progress=False)
    assert [{k: r[k] for k in keys} for r in rows(forced.out)] == [{k: r[k] for k in keys} for r in rows(plain.out)]
    same = ("kl", "ce", "top1", "tokens", "bits_per_byte")
    assert ([{k: r[k] for k in same} for r in rows(forced.out, "eval")]
            == [{k: r[k] for k in same} for r in rows(plain.out, "eval")])


def test_mistakes_cost_seconds(text_cache, tiny_teacher, bpe8k, tmp_path, capsys):
    not_a_tokenizer = tmp_path / "empty"
    not_a_tokenizer.mkdir()
    with pytest.raises(DistillUserError, match="^--tokenizer: cannot load a tokenizer"):
        train(config(text_cache, tiny_teacher, tmp_path / "a", tokenizer=str(not_a_tokenizer)), progress=False)
    with pytest.raises(DistillUserError, match="^--tokenizer: the cache .* another tokenizer.*--cross-tokenizer auto"):
        train(config(text_cache, tiny_teacher, tmp_path / "b", tokenizer=str(bpe8k), cross_tokenizer="off"),
              progress=False)
    # an older cache without its tokenizer files: refused, with the command that adds them
    old = tmp_path / "old"
    shutil.copytree(text_cache, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["tokenizer"].pop("files")
    (old / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(old / "tokenizer")
    with pytest.raises(DistillUserError, match="^--cache: .* holds no tokenizer files.*distill add-tokenizer"):
        train(config(old, tiny_teacher, tmp_path / "c", tokenizer=str(bpe8k)), progress=False)
    assert not (tmp_path / "c" / "metrics.jsonl").exists()
    # the CLI says it in one line
    code, _, err = run_cli(["train-student", "--cache", old, "--teacher", tiny_teacher, "--num-layers", "1",
                            "--tokenizer", bpe8k, "--out", tmp_path / "d", "--device", "cpu"], capsys)
    assert "add-tokenizer" in one_error_line(code, err)


def test_a_recipe_takes_the_new_options(tmp_path, bpe8k):
    from pipelines.recipe import load_recipe, train_config

    recipe = tmp_path / "r.toml"
    recipe.write_text(f"""name = "x"
[cache]
out = "caches/x"
[train]
out = "runs/x"
tokenizer = "{bpe8k}"
cross_tokenizer = "byte-prefix"
embedding_init = "random"
[sweep]
"train.cross_tokenizer" = ["byte-prefix", "auto"]
""")
    loaded = load_recipe(recipe)
    configs = [train_config(point, tmp_path) for point in loaded.points]
    assert [c.cross_tokenizer for c in configs] == ["byte-prefix", "auto"]
    assert all(c.tokenizer == str(bpe8k) and c.embedding_init == "random" for c in configs)


def test_batches_built_on_several_workers_come_in_order_and_resume(text_cache, tiny_teacher, bpe8k):
    """Prefetcher's workers build cross-tokenizer batches at once: the same batches in the same order,
    and the same position to resume from, as one worker."""
    from transformers import AutoTokenizer

    from student.cross_tokenizer.batches import CrossTokenizer, CrossTokenizerBatches
    from student.data import Prefetcher
    from teacher_cache.reader import CacheReader
    from teacher_cache.tokenizer_files import load_cache_tokenizer

    cross = CrossTokenizer.between(load_cache_tokenizer(text_cache), AutoTokenizer.from_pretrained(bpe8k))
    runs = []
    for workers in (1, 3):
        batches = CrossTokenizerBatches(CacheReader(text_cache), list(range(20)), 3, cross=cross, seed=1)
        with Prefetcher(batches, workers=workers) as stream:
            runs.append([(next(stream), stream.state_dict()) for _ in range(9)])  # past the first epoch
    for (a, state_a), (b, state_b) in zip(*runs):
        assert state_a == state_b
        for x, y in zip(vars(a).values(), vars(b).values()):
            if x is not None:
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)  # target_logprob: NaN


def test_a_tokenizer_that_cannot_say_its_bytes_is_refused_before_training(text_cache, tiny_teacher, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<unk>": 0, "def": 1, "return": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(tmp_path / "words")
    code, _, err = run_cli(["train-student", "--cache", text_cache, "--student", tmp_path / "nowhere",
                            "--tokenizer", tmp_path / "words", "--out", tmp_path / "run", "--device", "cpu"], capsys)
    line = one_error_line(code, err)
    assert "--tokenizer" in line and "bytes" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
