"""`distill eval --teacher`: the exact full-vocabulary KL and the calibration error against an
independent float64 computation from transformers' own logits, on a cache of the tests' tiny
teacher at temperature 2 (so a metric at the wrong temperature fails); 0 for the teacher itself;
the cache-based KL a lower bound of it; ECE by hand; and the checks of the teacher folder."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch

from cli_helpers import one_error_line, run_cli
from distill.errors import DistillUserError
from pipelines.teacher_eval import EvalTeacher
from student.evaluate import CALIBRATION_BINS, Calibration, evaluate_against_teacher, evaluate_run_or_folder
from student.long_context.config import LongContextConfig
from student.model import Student
from teacher_cache.reader import CacheReader

CACHE_TEMPERATURE = 2.0


def derived(teacher_dir, tokenizer, out, noise: float, logit_scale: float = 1.0):
    """The teacher's folder with Gaussian noise of std `noise` added to every weight (seeded) and its
    (tied) embedding scaled by `logit_scale`, which scales its logits; tokenizer included."""
    model = Student.from_pretrained(teacher_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
        model.embed_tokens.weight.mul_(logit_scale)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sharp_teacher(tiny_teacher, teacher_tokenizer, tmp_path_factory):
    """The tests' tiny random teacher with logits scaled up, so its distributions are peaked (as a
    trained teacher's are) rather than near uniform over the 49,152 ids."""
    return derived(tiny_teacher, teacher_tokenizer, tmp_path_factory.mktemp("teacher_eval") / "teacher", 0.0, 40.0)


@pytest.fixture(scope="module")
def tiny_cache(sharp_teacher, teacher_tokenizer, tmp_path_factory):
    """The sharp teacher's top-8 cache of 6 stdlib sequences of 24 tokens, the last cut to 13 (so
    batches hold padding rows), fp32 values, temperature 2."""
    from pipelines.corpus import CorpusConfig, prepare_corpus
    from teacher_cache.backends import make_backend
    from teacher_cache.build import CacheConfig, build_cache
    from teacher_cache.identity import tokenizer_info

    corpus = prepare_corpus(CorpusConfig(seq_len=24, max_sequences=6), teacher_tokenizer, progress=False)
    corpus.sequences[-1] = corpus.sequences[-1][:13]
    backend = make_backend("hf", sharp_teacher, dtype="float32", device="cpu", batch_size=6,
                           temperature=CACHE_TEMPERATURE)
    out = tmp_path_factory.mktemp("teacher_eval") / "cache"
    try:
        build_cache(corpus.sequences, backend,
                    CacheConfig(out=out, k=8, value_codec="fp32", shard_size=3, temperature=CACHE_TEMPERATURE),
                    tokenizer=tokenizer_info(teacher_tokenizer), progress=False,
                    data={"source": corpus.source, "fingerprint": "stdlib, last sequence cut", "seq_len": 24})
    finally:
        backend.close()
    return out


@pytest.fixture(scope="module")
def tiny_student(sharp_teacher, teacher_tokenizer, tmp_path_factory):
    return derived(sharp_teacher, teacher_tokenizer, tmp_path_factory.mktemp("teacher_eval") / "student", 0.1)


def brute_force(student_dir, teacher_dir, reader, indices):
    """(mean full-vocabulary KL at the cache's temperature, ECE of the student's top-1 at temperature 1 in
    15 bins (lo, hi]), in float64 from transformers' logits, one sequence at a time, bins counted in a loop."""
    from transformers import AutoModelForCausalLM

    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (student_dir, teacher_dir)]
    kls, confidences, correct = [], [], []
    for i in indices:
        ids = torch.from_numpy(reader.sequence(i).input_ids.astype(np.int64))[None]
        with torch.no_grad():
            zs, zt = (m(input_ids=ids).logits[0].double() for m in models)
        logp, logq = torch.log_softmax(zt / CACHE_TEMPERATURE, -1), torch.log_softmax(zs / CACHE_TEMPERATURE, -1)
        kls.extend((logp.exp() * (logp - logq)).sum(-1).tolist())
        q1 = torch.softmax(zs, -1)[:-1]  # rows with a next token, at temperature 1
        confidences.extend(q1.max(-1).values.tolist())
        correct.extend((q1.argmax(-1) == ids[0, 1:]).tolist())
    ece, n = 0.0, len(confidences)
    for b in range(CALIBRATION_BINS):
        lo, hi = b / CALIBRATION_BINS, (b + 1) / CALIBRATION_BINS
        members = [j for j, c in enumerate(confidences) if lo < c <= hi or (b == 0 and c == 0)]
        if members:
            acc = sum(correct[j] for j in members) / len(members)
            conf = sum(confidences[j] for j in members) / len(members)
            ece += len(members) / n * abs(acc - conf)
    return float(np.mean(kls)), ece


def test_full_vocab_kl_and_calibration_match_a_float64_brute_force(tiny_student, sharp_teacher, tiny_cache):
    reader = CacheReader(tiny_cache)
    indices = [0, 2, 3, 5]
    kl, ece = brute_force(tiny_student, sharp_teacher, reader, indices)
    student, teacher = Student.from_pretrained(tiny_student), EvalTeacher(sharp_teacher)(reader, "cpu")
    whole, teacher_ece = evaluate_against_teacher(student, teacher, reader, indices, batch_size=4, device="cpu")
    assert whole.full_vocab_kl == pytest.approx(kl, rel=1e-4) and whole.calibration_error == pytest.approx(ece, abs=1e-5)
    assert whole.full_vocab_kl > 0.05 and whole.calibration_error > 0.01  # a real difference, not two zeros
    # Chunked equals unchunked: batches of 2, row chunks of 7, sequences in chunks of 10 tokens.
    chunked, chunked_teacher_ece = evaluate_against_teacher(student, teacher, reader, indices, batch_size=2,
                                                            device="cpu", row_chunk=7,
                                                            long=LongContextConfig(chunk_tokens=10))
    assert chunked.full_vocab_kl == pytest.approx(whole.full_vocab_kl, rel=1e-5)
    assert chunked.calibration_error == pytest.approx(whole.calibration_error, abs=1e-6)
    assert chunked_teacher_ece == pytest.approx(teacher_ece, abs=1e-6)
    assert (chunked.kl, chunked.ce, chunked.tokens) == pytest.approx((whole.kl, whole.ce, whole.tokens), rel=1e-4)


def test_the_teacher_against_itself_is_zero_and_the_cache_kl_is_a_lower_bound(tiny_student, sharp_teacher,
                                                                               tiny_cache):
    itself = evaluate_run_or_folder(sharp_teacher, cache=tiny_cache, device="cpu", teacher=EvalTeacher(sharp_teacher))
    assert itself["student"].full_vocab_kl == pytest.approx(0.0, abs=1e-6)
    assert itself["student"].calibration_error == pytest.approx(itself["teacher"].calibration_error, abs=1e-6)
    result = evaluate_run_or_folder(tiny_student, cache=tiny_cache, device="cpu", teacher=EvalTeacher(sharp_teacher))
    student = result["student"]
    # KL_NOTE: merging the ids outside the top-8 into one category can only lower the KL.
    assert student.kl > 1e-3 and student.full_vocab_kl > 10 * student.kl
    assert result["teacher"].full_vocab_kl == 0.0
    assert result["teacher"].calibration_error == pytest.approx(itself["teacher"].calibration_error)
    assert "lower bound" in result["kl_note"] and "whole vocabulary" in result["full_vocab_note"]
    without = evaluate_run_or_folder(tiny_student, cache=tiny_cache, device="cpu")
    assert without["student"].full_vocab_kl is None and "full_vocab_note" not in without
    assert without["student"].kl == pytest.approx(student.kl) and "full_vocab_kl" not in without["student"].to_dict()


def test_ece_of_a_hand_made_case_with_empty_bins():
    calibration = Calibration()
    # bin 0 = (0, 1/15]: 0.05 wrong, 0.06 right; bin 7 = (7/15, 8/15]: 0.5 right, 0.52 wrong;
    # bin 13 = (13/15, 14/15]: 0.9 right; bin 14: 1.0 right; bins 8 and 9 below; the other 9 are empty.
    calibration.add(torch.tensor([0.05, 0.06, 0.5], dtype=torch.float64), torch.tensor([False, True, True]))
    calibration.add(torch.tensor([0.52, 0.9, 1.0], dtype=torch.float64), torch.tensor([False, True, True]))
    # on an edge: 0.6 = 9/15 closes bin 8 = (8/15, 9/15] (wrong); 0.62 is in bin 9 (right)
    calibration.add(torch.tensor([0.6, 0.62], dtype=torch.float64), torch.tensor([False, True]))
    by_hand = (2 * abs(1 / 2 - 0.055) + 2 * abs(1 / 2 - 0.51) + abs(1 - 0.9) + abs(1 - 1.0)
               + abs(0 - 0.6) + abs(1 - 0.62)) / 8
    assert calibration.error() == pytest.approx(by_hand, abs=1e-12)
    assert Calibration().error() == 0.0  # no rows


def test_ece_is_zero_when_confidence_is_accuracy():
    """Per bin the accuracy equals the confidence: 3 of 4 right at 0.75, 1 of 4 at 0.25, 0.6 once
    in five at 0.6 (ten rows); the logits path gets the same rows from logits of those softmaxes."""
    calibration = Calibration()
    calibration.add(torch.tensor([0.75] * 4 + [0.25] * 4, dtype=torch.float64), torch.tensor([True, True, True, False,
                                                                         True, False, False, False]))
    calibration.add(torch.tensor([0.6] * 5, dtype=torch.float64), torch.tensor([True, True, True, False, False]))
    assert calibration.error() == pytest.approx(0.0, abs=1e-12)
    from_logits = Calibration()
    logits = torch.log(torch.tensor([[0.75, 0.25, 1e-9]] * 4 + [[0.25, 0.1, 0.65]] * 4))
    # top-1 is id 0 in the first four rows (right 3 times), id 2 at 0.65 in the others (right 2 of 4 -> 0.5)
    target = torch.tensor([0, 0, 0, 1, 2, 2, 0, 1])
    from_logits.add_logits(logits, target, torch.ones(8, dtype=torch.bool))
    assert from_logits.error() == pytest.approx((4 * 0.0 + 4 * abs(0.5 - 0.65)) / 8, abs=1e-6)
    masked = Calibration()  # rows without a next token are left out
    masked.add_logits(logits, target, torch.tensor([True] * 4 + [False] * 4))
    assert masked.error() == pytest.approx(0.0, abs=1e-6)


def test_the_teacher_folder_is_checked_against_the_cache(sharp_teacher, tiny_cache, teacher_tokenizer, tmp_path,
                                                         caplog):
    reader = CacheReader(tiny_cache)
    other = tmp_path / "other_tokenizer"
    shutil.copytree(sharp_teacher, other)
    tokenizer = type(teacher_tokenizer).from_pretrained(sharp_teacher)
    tokenizer.add_tokens(["<not-in-the-cache>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(DistillUserError, match=r"^--teacher .*other_tokenizer: its tokenizer .* not the cache's"):
        EvalTeacher(other)(reader, "cpu")
    retrained = derived(sharp_teacher, teacher_tokenizer, tmp_path / "retrained", 1e-3)
    with caplog.at_level(logging.WARNING, logger="pipelines.teacher_eval"):
        EvalTeacher(retrained)(reader, "cpu")
    assert "its weights differ from those the cache was built from" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipelines.teacher_eval"):
        EvalTeacher(sharp_teacher)(reader, "cpu")
    assert "weights differ" not in caplog.text


def test_cli_eval_teacher_adds_both_figures_to_table_and_json(tiny_student, sharp_teacher, tiny_cache, tmp_path,
                                                              capsys):
    args = ["eval", tiny_student, "--cache", tiny_cache, "--teacher", sharp_teacher, "--device", "cpu", "-q"]
    code, stdout, err = run_cli([*args, "--json"], capsys)
    assert code == 0, err
    got = json.loads(stdout)
    assert got["student"]["full_vocab_kl"] > got["student"]["kl"] > 0 and 0 < got["student"]["calibration_error"] < 1
    assert got["teacher"]["full_vocab_kl"] == 0.0 and "full_vocab_note" in got and "lower bound" in got["kl_note"]
    code, stdout, err = run_cli(args, capsys)
    assert code == 0, err
    assert "full-vocab KL" in stdout and "ECE" in stdout and "exact KL(teacher || student)" in stdout
    bad = tmp_path / "no_teacher"
    bad.mkdir()
    code, _, err = run_cli(["eval", tiny_student, "--cache", tiny_cache, "--teacher", bad, "--device", "cpu", "-q"],
                           capsys)
    assert one_error_line(code, err).startswith("error: --teacher: teacher folder") and "no_teacher has no config.json" in err


def test_the_kl_note_follows_the_cache_kind():
    """A sampled cache's cache-based kl is the RS-KD estimate, and the note and the table say so; a
    manifest without a kind (every cache before sampled ones) is top-k."""
    from types import SimpleNamespace

    from distill.cli import _eval_table
    from student.evaluate import KL_NOTE, SAMPLED_KL_NOTE, EvalResult, kl_note

    reader = lambda **targets: SimpleNamespace(manifest=SimpleNamespace(spec=SimpleNamespace(
        targets=SimpleNamespace(k=12, temperature=1.0, **targets))))
    assert kl_note(reader()) == kl_note(reader(kind="topk")) == KL_NOTE
    assert kl_note(reader(kind="sampled")) == SAMPLED_KL_NOTE and "estimate" in SAMPLED_KL_NOTE
    row = EvalResult(kl=0.5, ce=2.0, ppl=7.39, top1=0.4, tokens=10)
    table = _eval_table({"teacher": row, "student": row, "kl_note": SAMPLED_KL_NOTE})
    # the note names the JSON field `kl`; under the table it begins with the column's name
    assert "KL (estimate)" in table and "\nKL" + SAMPLED_KL_NOTE.removeprefix("kl") in table
    assert "full-vocab KL" not in table
    assert "KL (top-k bound)" in _eval_table({"teacher": row, "student": row})
