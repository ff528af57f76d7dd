"""student.evaluate: the held-out metrics against an independent float64 computation, the teacher's
own numbers from the cache, `distill eval` on a run dir and on a folder, and the real SmolLM2
teacher scored against its own cache (KL 0, its own cross-entropy)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from student.data import CacheBatches
from student.evaluate import KL_NOTE, evaluate_run_or_folder, evaluate_student, teacher_reference
from student.model import Student
from student.trainer import TrainConfig, train
from distill.errors import DistillUserError
from teacher_cache.reader import CacheReader
from test_cache_synth import write_cache
from test_trainer import config, tiny  # noqa: F401  (the module-scoped fixture)


def reference_metrics(model, corpus, indices):
    """KL over top-k + tail, CE and top-1 in float64 from full logits, one sequence at a time."""
    kl, ce, hits, rows, ce_rows = 0.0, 0.0, 0, 0, 0
    for i in indices:
        ids, t = corpus.sequences[i], corpus.targets[i]
        with torch.no_grad():
            logits = model.logits(model(torch.from_numpy(ids).long()[None]))[0].double()
        logq = torch.log_softmax(logits, -1).numpy()
        q = np.exp(logq)
        p_top = np.exp(t.topk_logprobs.astype(np.float64))
        p_tail = np.exp(t.tail_logmass.astype(np.float64))
        z = p_top.sum(1) + p_tail
        p_top, p_tail = p_top / z[:, None], p_tail / z
        q_top = np.take_along_axis(q, t.topk_ids.astype(np.int64), 1)
        q_tail = 1 - q_top.sum(1)
        kl += ((p_top * (np.log(p_top) - np.log(q_top))).sum(1) + p_tail * (np.log(p_tail) - np.log(q_tail))).sum()
        ce -= logq[np.arange(len(ids) - 1), ids[1:]].sum()
        hits += (logq.argmax(1) == t.topk_ids[:, 0]).sum()
        rows, ce_rows = rows + len(ids), ce_rows + len(ids) - 1
    return kl / rows, ce / ce_rows, hits / rows, rows


def test_student_metrics_match_a_float64_reference_in_any_chunking(tiny):  # noqa: F811
    student, cache, corpus = tiny
    model, reader = Student.from_pretrained(student), CacheReader(cache)
    indices = [1, 5, 6, 11, 20]
    kl, ce, top1, rows = reference_metrics(model, corpus, indices)
    for batch_size, chunk in ((5, 1024), (2, 7)):
        got = evaluate_student(model, reader, indices, batch_size=batch_size, device="cpu", row_chunk=chunk)
        assert got.tokens == rows
        assert got.kl == pytest.approx(kl, rel=1e-5) and got.ce == pytest.approx(ce, rel=1e-5)
        assert got.top1 == pytest.approx(top1) and got.ppl == pytest.approx(np.exp(ce), rel=1e-5)


def test_kl_is_the_kernels_bucket_mode_at_t1(tiny):  # noqa: F811
    from kernels.fused_topk_kl import fused_topk_kl

    student, cache, _ = tiny
    model, reader = Student.from_pretrained(student), CacheReader(cache)
    batch = next(CacheBatches(reader, range(24), 24, shuffle=False).epoch_batches())
    with torch.no_grad():
        hidden = model(batch.input_ids).reshape(-1, 32)
        bucket = fused_topk_kl(hidden, model.lm_head_weight, batch.topk_ids, batch.topk_logprobs,
                               batch.tail_logmass, mask=batch.mask, tail="bucket")
    got = evaluate_student(model, reader, range(24), batch_size=24, device="cpu")
    assert got.kl == pytest.approx(bucket.item(), rel=1e-5)


def test_teacher_reference_comes_from_the_cache(tiny):  # noqa: F811
    _, cache, corpus = tiny
    ref = teacher_reference(CacheReader(cache), [0, 3, 9])
    lp = np.concatenate([corpus.targets[i].target_logprob[:-1] for i in (0, 3, 9)])
    assert ref.ce == pytest.approx(-lp.astype(np.float64).mean(), rel=1e-6)
    assert (ref.kl, ref.top1, ref.tokens) == (0.0, 1.0, sum(len(corpus.sequences[i]) for i in (0, 3, 9)))


def test_eval_of_a_run_dir_and_of_a_folder(tiny, tmp_path):  # noqa: F811
    student, cache, _ = tiny
    out = tmp_path / "run"
    report = train(config(tiny, out, steps=3, eval_sequences=3), progress=False)
    result = evaluate_run_or_folder(out, device="cpu")
    assert result["after"] == report.final_eval and result["before"] == report.initial_eval
    assert result["teacher"] == report.teacher_eval and result["num_sequences"] == 3
    folder = evaluate_run_or_folder(out / "student", cache=cache, heldout=4, device="cpu")
    assert set(folder) == {"teacher", "student", "cache", "num_sequences", "kl_note"} and folder["num_sequences"] == 4
    assert folder["kl_note"] == KL_NOTE  # a top-k cache
    assert folder["student"].tokens > result["after"].tokens
    # other sequences: no comparable "before"; a folder batches by 8 unless told, a run by its own size
    other = evaluate_run_or_folder(out, heldout=4, device="cpu", batch_size=8)
    assert other["before"] is None and other["after"] == folder["student"]
    with pytest.raises(DistillUserError, match="pass the cache"):
        evaluate_run_or_folder(out / "student")
    with pytest.raises(DistillUserError, match="neither a run directory"):
        evaluate_run_or_folder(tmp_path)


def test_evaluations_inside_training_show_a_bar_that_progress_controls(tiny, tmp_path, capsys):  # noqa: F811
    """Each evaluation of a run (step 0, the periodic ones) draws an "eval" bar over the held-out
    sequences while it runs, gone once done; progress=False (--quiet) prints nothing at all."""
    train(config(tiny, tmp_path / "quiet", steps=2, eval_every=1), progress=False)
    assert capsys.readouterr().err == ""
    train(config(tiny, tmp_path / "shown", steps=2, eval_every=1), progress=True)
    err = capsys.readouterr().err
    assert err.count("eval:   0%|          | 0/4 ") == 3  # steps 0, 1 and 2, over the 4 held-out sequences
    assert "train: 100%" in err


def test_eval_refuses_a_cache_of_another_tokenizer(tiny, tmp_path):  # noqa: F811
    """As train-student does: a student folder (its tokenizer) or a run (its tokenizer) against a cache
    built with another tokenizer is read across tokenizers, which needs the cache's tokenizer files:
    refused, naming the command that adds them."""
    student, _, corpus = tiny
    other = tmp_path / "other"
    write_cache(other, corpus, tokenizer__hash="0123456789abcdef", shard_size=4, fmt="parquet")
    with pytest.raises(DistillUserError, match="holds no tokenizer files.*add-tokenizer"):
        evaluate_run_or_folder(student, cache=other, device="cpu")
    out = tmp_path / "run"
    train(config(tiny, out, steps=1, eval_every=0), progress=False)
    with pytest.raises(DistillUserError, match="holds no tokenizer files.*add-tokenizer"):
        evaluate_run_or_folder(out, cache=other, device="cpu")
    bare = tmp_path / "bare"  # a checkpoint's model folder has no tokenizer files: say how to give one
    shutil.copytree(out / "checkpoints" / "step-000001" / "model", bare)
    with pytest.raises(DistillUserError, match="--tokenizer: cannot load a tokenizer from .*bare"):
        evaluate_run_or_folder(bare, cache=tiny[1], device="cpu")
    assert evaluate_run_or_folder(bare, cache=tiny[1], tokenizer=student, device="cpu")["student"].tokens > 0


@pytest.fixture(scope="module")
def smol_cache(teacher_dir, teacher_tokenizer, tmp_path_factory):
    """A real SmolLM2-135M cache: 6 stdlib sequences of 32 tokens, k = 16, fp32 values."""
    from pipelines.corpus import CorpusConfig, prepare_corpus
    from teacher_cache.backends import make_backend
    from teacher_cache.build import CacheConfig, build_cache
    from teacher_cache.identity import tokenizer_info

    corpus = prepare_corpus(CorpusConfig(seq_len=32, max_sequences=6), teacher_tokenizer, progress=False)
    backend = make_backend("hf", teacher_dir, dtype="float32", device="cpu", batch_size=6)
    out = tmp_path_factory.mktemp("smol") / "cache"
    try:
        build_cache(corpus.sequences, backend, CacheConfig(out=out, k=16, value_codec="fp32", shard_size=3),
                    tokenizer=tokenizer_info(teacher_tokenizer), progress=False,
                    data={"source": corpus.source, "fingerprint": corpus.fingerprint, "seq_len": corpus.seq_len})
    finally:
        backend.close()
    return out


def test_real_teacher_against_its_own_cache_and_a_pruned_student(teacher_dir, smol_cache, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reader = CacheReader(smol_cache)
    teacher = Student.from_pretrained(teacher_dir)
    own = evaluate_student(teacher, reader, [1, 4], batch_size=2, device="cpu")
    ref = teacher_reference(reader, [1, 4])
    assert own.kl < 1e-4 and own.top1 > 0.95 and own.ce == pytest.approx(ref.ce, rel=1e-4)
    del teacher

    cfg = TrainConfig.from_flat(cache=str(smol_cache), out=str(tmp_path / "run"), teacher=str(teacher_dir),
                                num_layers=2, steps=2, batch_size=2, heldout=2, lr=1e-4, warmup_steps=1, eval_every=0,
                                save_every=0, log_every=1)
    report = train(cfg, progress=False)
    assert report.initial_eval.kl > report.teacher_eval.kl == 0 and report.initial_eval.ce > report.teacher_eval.ce
    hf = AutoModelForCausalLM.from_pretrained(report.student_dir)
    tok = AutoTokenizer.from_pretrained(report.student_dir)
    ids = tok("def add(a, b):\n    return", return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5) and isinstance(tok.decode(out[0]), str)
    assert hf.config.num_hidden_layers == 2 and tok.eos_token_id == 2
    result = evaluate_run_or_folder(tmp_path / "run", device=cfg.device)
    assert result["before"] == report.initial_eval and result["after"] == report.final_eval
