"""student.data and student.trainer on tiny random students and small synthetic caches written by
the real CacheWriter: batches, the loop, checkpoints, exact resume after a kill, the final HF
folder in transformers, and every error a user can cause."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import signal
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from student.config import StudentConfig
from student.data import CacheBatches, split_indices
from student.model import Student
from student.loss import LossConfig
from student.trainer import NonFiniteLossError, RunDirError, TrainConfig, train
from distill.configs import ConfigError
from distill.errors import DistillUserError
from teacher_cache.errors import CacheError, CorruptShardError
from teacher_cache.reader import CacheReader
from test_cache_synth import make_corpus, make_spec, write_cache

VOCAB = 300
REPO = Path(__file__).resolve().parents[1]


def make_tokenizer(folder: Path):
    """A word-level tokenizer over VOCAB ids ("w3" .. "w299"), saved as an HF tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def tokenizer_hash(folder: Path) -> str:
    from transformers import AutoTokenizer

    from teacher_cache.identity import tokenizer_info

    return tokenizer_info(AutoTokenizer.from_pretrained(folder))["hash"]


def make_student(folder: Path, seed: int = 0, **changes) -> Path:
    torch.manual_seed(seed)
    config = StudentConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, extra={"bos_token_id": 1, "eos_token_id": 2})
    Student(config.replace(**changes)).save_pretrained(folder)
    make_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(student folder, cache dir, corpus): 24 ragged sequences of <= 24 tokens in 6 shards of 4."""
    root = tmp_path_factory.mktemp("tiny")
    student = make_student(root / "student")
    corpus = make_corpus(num_seqs=24, seq_len=24, k=8, vocab=VOCAB, seed=1)
    write_cache(root / "cache", corpus, tokenizer__hash=tokenizer_hash(student), shard_size=4, fmt="parquet")
    return student, root / "cache", corpus


def config(tiny, out, **overrides) -> TrainConfig:
    student, cache, _ = tiny
    base = dict(cache=str(cache), out=str(out), student=str(student), steps=6, batch_size=3, lr=1e-2,
                warmup_steps=2, heldout=4, eval_every=3, save_every=2, log_every=1, seed=0, deterministic=True,
                device="cpu")
    return TrainConfig.from_flat(**{**base, **overrides})


def rows(out, kind="train"):
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


# --- data ---------------------------------------------------------------------------------------


def test_split_indices_is_evenly_spaced_and_seed_free():
    train_idx, held = split_indices(20, 4)
    assert held == [2, 7, 12, 17] and sorted(train_idx + held) == list(range(20))
    assert split_indices(20, 4) == (train_idx, held)
    assert split_indices(5, 0) == ([0, 1, 2, 3, 4], [])
    with pytest.raises(DistillUserError, match="heldout"):
        split_indices(5, 5)


def test_batches_hold_the_cached_rows_with_next_token_targets(tiny):
    _, cache, corpus = tiny
    reader = CacheReader(cache)
    data = CacheBatches(reader, range(24), batch_size=5, seed=3)
    seen = []
    for _, batch in zip(range(4), data):  # 20 sequences of epoch 0
        B, L = batch.input_ids.shape
        assert batch.topk_ids.shape == (B * L, 8) and batch.topk_logprobs.dtype == torch.float32
        assert batch.input_ids.dtype == torch.int64 and batch.target_ids.shape == (B * L,)
        for b in range(B):
            ids = batch.input_ids[b].numpy()
            matches = [i for i, s in enumerate(corpus.sequences) if len(s) <= L and np.array_equal(ids[:len(s)], s)]
            i = matches[0]
            seen.append(i)
            n, rows_ = len(corpus.sequences[i]), slice(b * L, b * L + len(corpus.sequences[i]))
            np.testing.assert_array_equal(batch.topk_ids[rows_].numpy(), corpus.targets[i].topk_ids)
            np.testing.assert_array_equal(batch.tail_logmass[rows_].numpy(), corpus.targets[i].tail_logmass)
            np.testing.assert_array_equal(batch.target_ids[rows_][:-1].numpy(), corpus.sequences[i][1:])
            assert batch.target_ids[rows_][-1] == -1
            assert batch.mask[b * L:(b + 1) * L].sum() == n
            assert (batch.target_ids[b * L + n:(b + 1) * L] == -1).all()
    assert len(set(seen)) == 20
    # shards are visited whole: the 20 sequences of epoch 0 form runs of one shard each
    shard_runs = [k for k, _ in itertools.groupby(i // 4 for i in seen)]
    assert len(shard_runs) == len(set(shard_runs))


def test_batch_order_is_seeded_and_resumes_exactly(tiny):
    _, cache, _ = tiny
    reader = CacheReader(cache)
    a = CacheBatches(reader, range(24), batch_size=5, seed=0)
    it = iter(a)
    for _ in range(7):  # crosses into epoch 1
        next(it)
    state = a.state_dict()
    expected = [next(it).input_ids for _ in range(4)]
    b = CacheBatches(reader, range(24), batch_size=5, seed=0)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert state["epoch"] == 1
    for want, got in zip(expected, iter(b)):
        assert torch.equal(want, got.input_ids)
    order = lambda seed: CacheBatches(reader, range(24), 5, seed=seed).epoch_order(0)
    assert order(0) == order(0) and order(0) != order(1) and sorted(order(1)) == list(range(24))


def test_crop_keeps_the_next_token_target_inside_a_sequence(tiny):
    _, cache, corpus = tiny
    reader = CacheReader(cache)
    longest = max(range(24), key=lambda i: len(corpus.sequences[i]))
    seq = corpus.sequences[longest]
    batch = next(iter(CacheBatches(reader, [longest], 1, seq_len=5, seed=0)))
    ids = batch.input_ids[0].numpy()
    start = next(s for s in range(len(seq) - 4) if np.array_equal(seq[s:s + 5], ids))
    assert batch.input_ids.shape == (1, 5)
    expected = np.append(seq[start + 1:start + 6], -1)[:5] if start + 5 == len(seq) else seq[start + 1:start + 6]
    np.testing.assert_array_equal(batch.target_ids.numpy(), expected)


# --- the loop -----------------------------------------------------------------------------------


def test_train_writes_metrics_checkpoints_and_a_transformers_student(tiny, tmp_path, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    listing = lambda: sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in tiny[1].rglob("*"))
    before = listing()
    with caplog.at_level("INFO", logger="student.trainer"):
        report = train(config(tiny, out), progress=False)
    # the first and the mid-run evaluations reach the console, not only metrics.jsonl
    assert [m for m in caplog.messages if m.startswith("eval at step")][:2] == [
        f"eval at step {r['step']}: KL to teacher (top-k bound) {r['kl']:.4f}, CE {r['ce']:.3f}, PPL {r['ppl']:.2f}, "
        f"top-1 {r['top1']:.3f} ({r['tokens']:,} tokens)" for r in rows(out, "eval")[:2]]
    assert report.steps == 6 and report.resumed_from == 0
    assert listing() == before  # the cache is only read (several runs may share it)
    train_rows = rows(out)
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "kl", "lr", "grad_norm", "tokens", "tok_per_s"} <= set(train_rows[0])
    assert not any(k.startswith("ffn_") or k == "l1" for k in train_rows[0])  # sparse FFN rows only
    assert train_rows[0]["lr"] == pytest.approx(5e-3) and train_rows[1]["lr"] == pytest.approx(1e-2)
    assert train_rows[-1]["lr"] < train_rows[2]["lr"]
    assert [r["step"] for r in rows(out, "eval")] == [0, 3, 6]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004", "step-000006"]
    run = json.loads((out / "run.json").read_text())
    assert run["cache_id"] == CacheReader(tiny[1]).manifest.cache_id
    assert run["config"]["device"] == "cpu" and run["config"]["dtype"] == "float32"
    assert run["config"] == TrainConfig.from_flat(**run["config"]).to_flat()  # the resolved config, flat
    assert run["config"]["temperature"] == run["cache_temperature"] == 1.0  # both temperatures recorded
    assert run["student"]["config"]["num_hidden_layers"] == 2
    assert report.initial_eval.tokens == report.final_eval.tokens > 0
    assert report.teacher_eval.kl == 0 and report.teacher_eval.top1 == 1

    ours = Student.from_pretrained(out / "student")
    hf = AutoModelForCausalLM.from_pretrained(out / "student").eval()
    tok = AutoTokenizer.from_pretrained(out / "student")
    ids = tok("w5 w17 w200 w3", return_tensors="pt").input_ids
    assert ids.tolist() == [[5, 17, 200, 3]]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.logits(ours(ids)), atol=1e-5, rtol=1e-5)
        generated = hf.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8)
    initial = Student.from_pretrained(tiny[0])
    assert not torch.equal(ours.embed_tokens.weight, initial.embed_tokens.weight)  # it trained

    again = train(config(tiny, out), progress=False)  # a finished run: nothing to do
    assert again.resumed_from == 6 and again.final_eval == report.final_eval


_CHILD = """
import json, sys
from student.trainer import TrainConfig, train
train(TrainConfig.from_flat(**json.loads(sys.argv[1])), progress=False)
"""
KILLED = -signal.SIGKILL  # the return code of a child that tests/kill_after_step.py killed


def _train_in_subprocess(cfg: TrainConfig, exit_after: int | None = None) -> int:
    """Train `cfg` in a child process; with exit_after, the child is SIGKILLed right after that step
    (tests/kill_after_step.py). Returns its return code (0 or KILLED)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    kill = [] if exit_after is None else [str(REPO / "tests" / "kill_after_step.py"), str(exit_after)]
    proc = subprocess.run([sys.executable, *kill, "-c", _CHILD, json.dumps(cfg.to_flat())], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, KILLED), proc.stderr[-2000:]
    return proc.returncode


@pytest.mark.parametrize("optimizer", ["adamw", "foam", "adamw8bit"])
def test_killed_run_resumes_to_the_same_losses_bit_for_bit(tiny, tmp_path, optimizer):
    """Killed (SIGKILL) after step 5 with a checkpoint at 4, and its metric row
    for step 5 already written; the rerun drops that row, resumes at 4 and matches exactly. Two
    micro-batches per step and 8 steps of 6 sequences cross two epochs of the 20 train sequences.
    For every optimizer: their states (folded, 8-bit) must survive the checkpoint exactly."""
    kw = dict(steps=8, grad_accum=2, save_every=4, eval_every=4, optimizer=optimizer, foam_level=1)
    clean = train(config(tiny, tmp_path / "clean", **kw), progress=False)
    cfg = config(tiny, tmp_path / "killed", **kw)
    assert _train_in_subprocess(cfg, exit_after=5) == KILLED
    assert [r["step"] for r in rows(cfg.out)][-1] == 5 and not (Path(cfg.out) / "student").exists()
    assert _train_in_subprocess(cfg) == 0
    keys = ("step", "loss", "kl", "lr", "grad_norm", "tokens", "epoch")
    want = [{k: r[k] for k in keys} for r in rows(tmp_path / "clean")]
    got = [{k: r[k] for k in keys} for r in rows(cfg.out)]
    assert got == want and want[-1]["epoch"] >= 2
    assert rows(cfg.out, "eval") == rows(tmp_path / "clean", "eval")
    a = Student.from_pretrained(Path(clean.student_dir)).state_dict()
    b = Student.from_pretrained(Path(cfg.out) / "student").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resumed_sparse_run_matches_bit_for_bit(tiny, tmp_path):
    """A sparse FFN run (ReLU gate, L1 penalty) killed after step 5, checkpoint at 4, metrics every
    3 steps, so the sparsity window holding step 4 must travel in the checkpoint: every metric
    (per-layer nnz, dead neurons, reinitialised gate rows, l1), the losses and the weights equal the
    uninterrupted run's. The dead-neuron mitigation is on, judging every step (a one-token window):
    its noise must be drawn the same. (A window open at the checkpoint: test_sparse_ffn_student.)"""
    kw = dict(steps=6, grad_accum=2, save_every=4, eval_every=0, log_every=3, sparse_ffn=True, l1=0.05,
              dead_reinit=0.1, dead_window=1)
    clean = train(config(tiny, tmp_path / "clean", **kw), progress=False)
    cfg = config(tiny, tmp_path / "killed", **kw)
    assert _train_in_subprocess(cfg, exit_after=5) == KILLED
    assert [r["step"] for r in rows(cfg.out)] == [3]
    assert _train_in_subprocess(cfg) == 0
    drop = lambda r: {k: v for k, v in r.items() if k != "tok_per_s"}
    assert [drop(r) for r in rows(cfg.out)] == [drop(r) for r in rows(tmp_path / "clean")]
    assert [r["step"] for r in rows(cfg.out)] == [3, 6] and "ffn_dead" in rows(cfg.out)[-1]
    assert rows(cfg.out, "eval") == rows(tmp_path / "clean", "eval")
    a = Student.from_pretrained(Path(clean.student_dir)).state_dict()
    b = Student.from_pretrained(Path(cfg.out) / "student").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_ce_only_baseline_and_mixing_follow_the_kernel_terms(tiny, tmp_path):
    from kernels.fused_topk_kl import fused_topk_kl
    from student.step import micro_batch_loss, resolve

    student, cache, _ = tiny
    model = Student.from_pretrained(student)
    batch = next(iter(CacheBatches(CacheReader(cache), range(24), 4)))
    hidden_BLD = model(batch.input_ids)
    hidden = hidden_BLD.reshape(-1, 32)
    logq = torch.log_softmax(model.logits(hidden), -1)
    has = batch.mask & (batch.target_ids >= 0)
    ce = -logq.gather(1, batch.target_ids.clamp_min(0)[:, None])[:, 0][has].mean()
    kl = fused_topk_kl(hidden, model.lm_head_weight, batch.topk_ids, batch.topk_logprobs, batch.tail_logmass,
                       mask=batch.mask, tail=LossConfig().tail)
    for weight, expected in ((1.0, ce), (0.25, 0.75 * kl + 0.25 * ce), (0.0, kl)):
        cfg = resolve(config(tiny, tmp_path / "x", ce_weight=weight))
        loss, kl_metric = micro_batch_loss(hidden_BLD, [], batch, model, cfg, cache_temperature=1.0)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kl_metric, kl.detach(), rtol=1e-5, atol=1e-6)
    report = train(config(tiny, tmp_path / "ce", ce_weight=1.0, steps=2), progress=False)
    assert report.final_loss > 0 and rows(tmp_path / "ce")[0]["kl"] > 0


def test_train_from_a_pruned_teacher_folder(tiny, tmp_path):
    student, cache, _ = tiny
    teacher = make_student(tmp_path / "teacher", num_layers=4)
    cfg = config(tiny, tmp_path / "run", student=None, teacher=str(teacher), num_layers=2, steps=2)
    report = train(cfg, progress=False)
    assert Student.from_pretrained(report.student_dir).config.num_layers == 2
    assert (Path(report.student_dir) / "tokenizer.json").exists()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["student"]["init"].endswith("num_layers=2")


# --- errors a user can cause --------------------------------------------------------------------


def test_config_errors_name_the_field():
    with pytest.raises(DistillUserError, match="exactly one of `student`"):
        TrainConfig(cache="c", out="o")
    with pytest.raises(DistillUserError, match="`num_layers` is required"):
        TrainConfig(cache="c", out="o", teacher="t")
    with pytest.raises(DistillUserError, match=r"`ce_weight` must be in \[0, 1\], got 2"):
        TrainConfig.from_flat(cache="c", out="o", student="s", ce_weight=2)
    with pytest.raises(DistillUserError, match="`tail` must be one of"):
        TrainConfig.from_flat(cache="c", out="o", student="s", tail="none")
    with pytest.raises(ConfigError, match="`lr` must be a number, got '1e-3'") as e:
        TrainConfig.from_flat(cache="c", out="o", student="s", lr="1e-3")
    assert str(e.value.as_option()) == "--lr must be a number, got '1e-3'"
    with pytest.raises(DistillUserError, match="unknown training setting.*stepz"):
        TrainConfig.from_flat(cache="c", out="o", student="s", stepz=3)


def test_the_loss_config_offers_the_kernels_tails():
    import typing

    from kernels.fused_topk_kl import TAIL_MODES
    from student.loss_config import TailMode

    assert set(typing.get_args(TailMode)) == set(TAIL_MODES)


def test_flat_names_address_every_field_of_the_parts():
    from student.optim.config import OptimizerConfig
    from student.schedule import ScheduleConfig
    from student.sparse_ffn_config import SparseFFNConfig

    cfg = TrainConfig.from_flat(cache="c", out="o", student="s", steps=7, warmup_steps=2, lr=4e-3, optimizer="foam",
                                tail="renorm", temperature=2.0, sparse_ffn=True, l1=1e-4, batch_size=3)
    assert cfg.schedule == ScheduleConfig(steps=7, warmup_steps=2)
    assert cfg.optim == OptimizerConfig(optimizer="foam", lr=4e-3)
    assert cfg.loss == LossConfig(tail="renorm", temperature=2.0)
    assert cfg.sparse == SparseFFNConfig(sparse_ffn=True, l1=1e-4) and cfg.batch_size == 3
    flat = cfg.to_flat()
    assert TrainConfig.from_flat(**flat) == cfg and "schedule" not in flat and flat["lr"] == 4e-3
    changed = cfg.with_flat(lr=1e-3, out="p")
    assert changed.optim.lr == 1e-3 and changed.out == "p" and cfg.optim.lr == 4e-3
    assert set(TrainConfig.flat_defaults()) | {"cache", "out"} == set(flat)


def test_warmup_defaults_to_a_share_of_the_run(tiny, tmp_path, caplog):
    from student.schedule import ScheduleConfig, lr_factor

    assert ScheduleConfig(steps=1000).warmup == 50 and ScheduleConfig(steps=200).warmup == 10
    assert ScheduleConfig(steps=10).warmup == 1 and ScheduleConfig(steps=10, warmup_steps=0).warmup == 0
    assert lr_factor(0, ScheduleConfig(steps=200)) == pytest.approx(0.1)
    run = train(config(tiny, tmp_path / "run", warmup_steps=None, steps=2, eval_every=0), progress=False)
    assert json.loads((Path(run.run_dir) / "run.json").read_text())["config"]["warmup_steps"] == 1  # resolved
    with caplog.at_level("WARNING", logger="student.trainer"):
        train(config(tiny, tmp_path / "all-warmup", warmup_steps=5, steps=2, eval_every=0), progress=False)
    assert "warmup_steps 5 >= steps 2: the whole run is warmup" in caplog.text


def test_cache_of_another_tokenizer_or_incomplete_is_refused(tiny, tmp_path):
    from teacher_cache.writer import CacheWriter

    _, _, corpus = tiny
    write_cache(tmp_path / "other", corpus, tokenizer__hash="0123456789abcdef", shard_size=4, fmt="parquet")
    # another tokenizer's cache: with --cross-tokenizer off refused as such; by default it would need the
    # cache's tokenizer files, which this one lacks
    with pytest.raises(DistillUserError, match="^--tokenizer: the cache .* another tokenizer"):
        train(config(tiny, tmp_path / "r1", cache=str(tmp_path / "other"), cross_tokenizer="off"), progress=False)
    with pytest.raises(DistillUserError, match="^--cache: .* holds no tokenizer files"):
        train(config(tiny, tmp_path / "r1", cache=str(tmp_path / "other")), progress=False)
    writer = CacheWriter(tmp_path / "partial", make_spec(corpus, shard_size=4, fmt="parquet",
                                                          tokenizer__hash=tokenizer_hash(tiny[0])))
    writer.write_shard(0, *corpus.shard(0, 4))
    writer.close()
    with pytest.raises(CacheError, match="incomplete"):
        train(config(tiny, tmp_path / "r2", cache=str(tmp_path / "partial")), progress=False)
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
    shutil.copytree(tiny[1], tmp_path / "damaged")
    shard = sorted((tmp_path / "damaged" / "shards").iterdir())[0]
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated, as a partial copy leaves it
    with pytest.raises(CorruptShardError, match=f"{shard.name}: .* bytes on disk"):
        train(config(tiny, tmp_path / "r3", cache=str(tmp_path / "damaged")), progress=False)
    assert not (tmp_path / "r3").exists()  # found before the run directory is made


def test_run_dir_of_another_run_or_model_is_refused(tiny, tmp_path):
    out = tmp_path / "run"
    train(config(tiny, out, steps=2), progress=False)
    with pytest.raises(RunDirError, match=r"differs in batch_size: 3 -> 2; seed: 0 -> 1, which changes the model"):
        train(config(tiny, out, steps=2, lr=2e-2, seed=1, batch_size=2), progress=False)
    train(config(tiny, out, steps=2, log_every=5), progress=False)  # logging cadence may change

    wide = make_student(tmp_path / "wide", hidden_size=40)
    other = tmp_path / "other"
    train(config(tiny, other, student=str(wide), steps=2), progress=False)
    # the user copies the other run's checkpoint into this run
    (other / "checkpoints" / "step-000002").rename(out / "checkpoints" / "step-000003")
    with pytest.raises(RunDirError, match="of another model .*hidden_size: 40 \\(checkpoint\\) vs 32"):
        train(config(tiny, out, steps=2), progress=False)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="not empty and holds no run.json"):
        train(config(tiny, tmp_path / "junk"), progress=False)


def test_nan_loss_stops_names_the_last_checkpoint_and_a_lower_lr_continues(tiny, tmp_path, monkeypatch):
    """A diverging run stops at its first non-finite loss without saving, names the last checkpoint
    (its step and finite loss) without calling it good, and continues from it with a lower lr as
    the message says: the change is recorded in metrics.jsonl and run.json."""
    import kernels.fused_topk_kl as kl_module

    real, calls = kl_module.fused_topk_kl, {"n": 0}

    def blows_up_at_step_3(*args, **kwargs):  # a test double for a diverging loss (training calls only)
        loss, kl = real(*args, **kwargs)
        if not torch.is_grad_enabled():  # an evaluation
            return loss, kl
        calls["n"] += 1
        return (loss * float("nan"), kl) if calls["n"] == 3 else (loss, kl)

    monkeypatch.setattr(kl_module, "fused_topk_kl", blows_up_at_step_3)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match=r"not finite at step 3; .*the last checkpoint is \S*step-000002 "
                                                 r"\(step 2, loss [0-9.]+: the last saved with a finite loss") as e:
        train(config(tiny, out), progress=False)
    assert "lower --lr" in str(e.value) and "good" not in str(e.value)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    assert [r["step"] for r in rows(out)] == [1, 2] and not (out / "student").exists()
    monkeypatch.setattr(kl_module, "fused_topk_kl", real)
    again = train(config(tiny, out, lr=5e-3, warmup_steps=3), progress=False)
    assert again.resumed_from == 2 and again.steps == 6
    assert rows(out, "change") == [{"kind": "change", "step": 2,
                                    "changes": {"warmup_steps": [2, 3], "lr": [1e-2, 5e-3]}}]
    assert json.loads((out / "run.json").read_text())["config"]["lr"] == 5e-3
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5, 6]


def test_a_finished_run_is_extended_and_an_older_checkpoint_resumed(tiny, tmp_path):
    """More --steps continue a finished run from its last checkpoint (recorded); fewer steps than it
    holds are refused; resume_from picks an older kept checkpoint and replays the same steps."""
    out = tmp_path / "run"
    first = train(config(tiny, out, steps=4, eval_every=0), progress=False)
    before = rows(out)
    longer = train(config(tiny, out, steps=6, eval_every=0), progress=False)
    assert (longer.resumed_from, longer.steps) == (4, 6) and [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5, 6]
    assert rows(out, "change") == [{"kind": "change", "step": 4, "changes": {"steps": [4, 6]}}]
    assert rows(out)[:4] == before and first.final_eval != longer.final_eval
    with pytest.raises(ConfigError, match="`steps` is 3, below the run's last checkpoint at step 6"):
        train(config(tiny, out, steps=3, eval_every=0), progress=False)
    with pytest.raises(RunDirError, match=r"no checkpoint at step 3 \(kept: 4, 6\)"):
        train(config(tiny, out, steps=6, eval_every=0), progress=False, resume_from=3)
    extended = rows(out)
    replay = train(config(tiny, out, steps=6, eval_every=0), progress=False, resume_from=4)
    assert (replay.resumed_from, replay.steps) == (4, 6)
    keys = ("step", "loss", "kl", "lr", "grad_norm")  # deterministic on the CPU: the same two steps again
    assert [{k: r[k] for k in keys} for r in rows(out)] == [{k: r[k] for k in keys} for r in extended]
    assert rows(out, "change") == [{"kind": "change", "step": 4, "changes": {"steps": [4, 6]}}]


@pytest.mark.parametrize("name, changed", [("adamw", {"weight_decay": 0.05}), ("foam", {"foam_scale": 0.5}),
                                           ("adamw8bit", {"weight_decay": 0.02})])
def test_a_resumed_optimizer_keeps_its_new_settings_and_its_saved_moments(tiny, name, changed):
    """Loading a checkpoint's optimizer state restores its moments but not its old hyperparameters: a
    continued run trains with the settings it was given."""
    from student.optim.build import build_optimizer, load_state_keeping_settings
    from student.optim.config import OptimizerConfig

    model = Student.from_pretrained(tiny[0])
    old = build_optimizer(model, OptimizerConfig(optimizer=name, foam_level=1), "cpu")
    sum(p.square().sum() for p in model.parameters()).backward()
    old.step()
    new = build_optimizer(model, OptimizerConfig(optimizer=name, foam_level=1, **changed), "cpu")
    load_state_keeping_settings(new, old.state_dict())
    (field, value), = changed.items()
    key = field.removeprefix("foam_")  # FOAM's group key of foam_scale
    assert new.param_groups[0][key] == value != old.param_groups[0][key]  # the matrices' group, first of each
    assert all(torch.equal(a, b) for a, b in zip(new.state_dict()["state"][0].values(),
                                                 old.state_dict()["state"][0].values()) if torch.is_tensor(a))


def test_a_moved_cache_is_the_same_cache(tiny, tmp_path):
    """The run knows its cache by id: a cache moved elsewhere (same cache_id) resumes, recorded."""
    shutil.copytree(tiny[1], tmp_path / "a")
    out = tmp_path / "run"
    train(config(tiny, out, cache=str(tmp_path / "a"), steps=2), progress=False)
    (tmp_path / "a").rename(tmp_path / "b")
    report = train(config(tiny, out, cache=str(tmp_path / "b"), steps=4), progress=False)
    assert report.resumed_from == 2 and report.steps == 4
    change = rows(out, "change")[0]["changes"]
    assert change["cache"] == [[str(tmp_path / "a")], [str(tmp_path / "b")]] and change["steps"] == [2, 4]


def hot_cache(tiny, path: Path, temperature: float) -> Path:
    """The tiny cache's teacher at another temperature: top-k, tail and target log-probs of
    log_softmax(logits / T), from the corpus' full distributions; the manifest says T."""
    from teacher_cache.targets import TeacherTargets

    _, _, corpus = tiny
    full = corpus.full_logprobs / temperature
    full = full - np.logaddexp.reduce(full, axis=1, keepdims=True)
    targets, start = [], 0
    for ids, t in zip(corpus.sequences, corpus.targets):
        rows_ = full[start:start + len(ids)]
        start += len(ids)
        topk = np.take_along_axis(rows_, t.topk_ids.astype(np.int64), 1)  # the same ids: T keeps the order
        target = np.full(len(ids), np.nan)
        target[:-1] = rows_[np.arange(len(ids) - 1), ids[1:]]
        targets.append(TeacherTargets(t.topk_ids, topk.astype(np.float32),
                                      np.log1p(-np.exp(topk).sum(1)).astype(np.float32), target.astype(np.float32)))
    write_cache(path, dataclasses.replace(corpus, targets=targets), tokenizer__hash=tokenizer_hash(tiny[0]),
                shard_size=4, fmt="parquet", targets__temperature=temperature)
    return path


def test_a_temperature_the_tail_cannot_compose_is_refused_before_training(tiny, tmp_path):
    """With the bucket (default) or unnormalized tail the distillation temperature must be the cache's:
    the cached tail mass cannot be re-tempered. One line names both ways out; no run dir is made."""
    for tail in ("bucket", "unnormalized"):
        with pytest.raises(ConfigError, match=r"`temperature` is 2 but the cache holds the teacher at temperature 1, "
                                              rf"and the '{tail}' tail .*--temperature 2\).*--tail renorm"):
            train(config(tiny, tmp_path / "r", tail=tail, temperature=2.0), progress=False)
    assert not (tmp_path / "r").exists()
    hot = hot_cache(tiny, tmp_path / "hot", 2.0)
    with pytest.raises(ConfigError, match="`temperature` is 1 but the cache holds the teacher at temperature 2"):
        train(config(tiny, tmp_path / "r", cache=str(hot), temperature=1.0), progress=False)


def test_a_hot_cache_is_not_tempered_twice(tiny, tmp_path):
    """A T=2 cache trained at its own temperature (None: the cache's) with renorm equals a T=1 cache
    trained at T=2 with renorm (which composes exactly); both temperatures are recorded; the bucket
    tail at the cache's temperature is accepted."""
    hot = hot_cache(tiny, tmp_path / "hot", 2.0)
    a = tmp_path / "a"
    train(config(tiny, a, cache=str(hot), tail="renorm", steps=3, eval_every=0), progress=False)
    train(config(tiny, tmp_path / "b", tail="renorm", temperature=2.0, steps=3, eval_every=0), progress=False)
    run = json.loads((a / "run.json").read_text())
    assert run["config"]["temperature"] == run["cache_temperature"] == 2.0
    for got, want in zip(rows(a), rows(tmp_path / "b"), strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and got["kl"] == pytest.approx(want["kl"], rel=1e-5)
    assert train(config(tiny, tmp_path / "c", cache=str(hot), steps=1), progress=False).steps == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_run_uses_bf16_autocast_and_resumes(tiny, tmp_path):
    from student.evaluate import evaluate_run_or_folder

    out = tmp_path / "run"
    report = train(config(tiny, out, device="auto", steps=4, save_every=2), progress=False)
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["device"] == "cuda" and run["config"]["dtype"] == "bfloat16"
    losses = [r["loss"] for r in rows(out)]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert Student.from_pretrained(report.student_dir).embed_tokens.weight.dtype == torch.float32
    shutil.rmtree(out / "checkpoints" / "step-000004")
    shutil.rmtree(out / "student")
    again = train(config(tiny, out, device="auto", steps=4, save_every=2), progress=False)
    assert again.resumed_from == 2 and [r["loss"] for r in rows(out)] == pytest.approx(losses, rel=1e-3)
    result = evaluate_run_or_folder(out, device="cuda")
    assert result["after"].tokens > 0 and np.isfinite(result["after"].kl)


def test_student_from_a_config_only_folder(tiny, tmp_path):
    """A folder with config.json and tokenizer but no weights: a random student of that shape."""
    import shutil

    student, _, _ = tiny
    folder = tmp_path / "shape"
    shutil.copytree(student, folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    report = train(config(tiny, tmp_path / "run", student=str(folder), steps=2), progress=False)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["student"]["init"].startswith("config:")
    trained = Student.from_pretrained(Path(report.student_dir))
    assert trained.config == Student.from_pretrained(student).config


def test_two_runs_read_one_cache_at_the_same_time(tiny, tmp_path):
    """Two processes train from one cache at once; both finish, each records the cache id, and the
    cache's files are untouched."""
    _, cache, _ = tiny
    before = {p: p.read_bytes() for p in sorted(Path(cache).rglob("*")) if p.is_file()}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD,
                               json.dumps(config(tiny, tmp_path / f"run{i}", seed=i).to_flat())],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
    ids = {json.loads((tmp_path / f"run{i}" / "run.json").read_text())["cache_id"] for i in range(2)}
    assert ids == {json.loads((Path(cache) / "manifest.json").read_text())["cache_id"]}
    assert {p: p.read_bytes() for p in sorted(Path(cache).rglob("*")) if p.is_file()} == before


def test_optimizers_report_their_state_bytes(tiny, tmp_path):
    """FOAM and 8-bit AdamW train, and their state bytes (in every training row) are below AdamW's."""
    from student.optim.foam import foam_state_bytes_formula

    state = {}
    for name, kw in (("adamw", {}), ("foam", {"foam_level": 2}), ("adamw8bit", {})):
        report = train(config(tiny, tmp_path / name, steps=2, optimizer=name, **kw), progress=False)
        assert math.isfinite(report.final_loss)
        state[name] = rows(tmp_path / name)[-1]["optimizer_state_bytes"]
    model = Student.from_pretrained(tiny[0])
    params = dict(model.named_parameters())
    # torch's AdamW: two fp32 moments and a 4-byte step tensor per parameter.
    assert state["adamw"] == 8 * sum(p.numel() for p in params.values()) + 4 * len(params)
    # FOAM: matrices folded, except the embedding and the lm-head (plain Adam, by default).
    folded = lambda n, p: p.ndim >= 2 and "embed_tokens" not in n and "lm_head" not in n
    want = sum(foam_state_bytes_formula(tuple(p.shape), 2) if folded(n, p) else 8 * p.numel()
               for n, p in params.items())
    assert state["foam"] == want < state["adamw"]
    assert state["adamw8bit"] <= state["adamw"]  # tiny tensors stay fp32 (min_8bit_size)


def test_a_divergence_before_any_checkpoint_says_one_thing():
    """With no checkpoint the message says a rerun starts over, and nothing about continuing from one."""
    from student.run_dir import diverged_message

    message = diverged_message(2, float("nan"), float("inf"), None, [])
    assert "a rerun starts over" in message and "continue from it" not in message and "--lr" in message
    with_one = diverged_message(6, float("nan"), 1.0, (Path("runs/x/checkpoints/step-000004"), 2.5), [])
    assert "step 4, loss 2.5" in with_one and "continue from it" in with_one and "starts over" not in with_one
