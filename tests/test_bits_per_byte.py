"""Bits per byte, the tokenizer-independent held-out measure (issue 42): a uniform student's by hand
(log2 V bits a token over hand-made byte lengths, special ids counting their bits and no bytes), the
teacher's from the cache's target_logprob, old results without it loading and showing "-", `distill
compare` showing it for runs over different caches while it blanks their per-token columns, and
`distill eval` end to end on a cache of the real (byte-level) teacher tokenizer."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from cli_helpers import one_error_line, run_cli
from distill.cli import _eval_table
from pipelines.experiments import read_run
from student.data import Batch
from student.evaluate import (BITS_PER_BYTE_NOTE, EvalResult, evaluate_run_or_folder, evaluate_student,
                              predicted_bytes, teacher_reference, token_bytes_of)
from student.model import Student
from teacher_cache.reader import CacheReader
from teacher_cache.token_bytes import token_pieces
from test_evaluate_teacher import sharp_teacher, tiny_cache, tiny_student  # noqa: F401  (module-scoped fixtures)
from test_trainer import VOCAB, tiny  # noqa: F401  (the module-scoped fixture)

INDICES = [0, 3, 9, 14]
# Hand-made byte lengths of the tiny vocabulary: every fifth id is "special" (0 bytes), the others 1..4.
TABLE = np.arange(VOCAB, dtype=np.int64) % 5


def _uniform_student(folder) -> Student:
    """The tiny student with a zero lm-head: every logit 0, so each next token costs exactly ln V nats."""
    model = Student.from_pretrained(folder)
    with torch.no_grad():
        model.lm_head_weight.zero_()
    return model


def _targets(corpus, indices) -> np.ndarray:
    """The actual next tokens of sequences `indices`: each sequence's ids after its first."""
    return np.concatenate([corpus.sequences[i][1:] for i in indices]).astype(np.int64)


def test_predicted_bytes_of_a_hand_made_batch_skip_padding_and_last_rows():
    """Two sequences of 3 positions; the second is 2 long (one padding row): the rows with a next
    token are 0, 1 and 3, predicting ids 4, 6 and 1 of 3 + 0 + 2 bytes (id 6 is special)."""
    ids = torch.tensor([[9, 4, 6], [8, 1, 0]])
    target = torch.tensor([4, 6, -1, 1, -1, -1])
    mask = torch.tensor([True, True, True, True, True, False])
    k = 2
    batch = Batch(ids, torch.zeros(6, k, dtype=torch.long), torch.zeros(6, k), torch.zeros(6), target,
                  torch.full((6,), float("nan")), mask)
    table = torch.tensor([0, 2, 0, 0, 3, 0, 0, 0, 0, 0])
    assert predicted_bytes(batch, table) == 5
    with pytest.raises(ValueError, match="token_bytes has 5 entries but a target id is 6"):
        predicted_bytes(batch, table[:5])


def test_a_uniform_student_costs_log2_v_bits_a_token_in_any_chunking(tiny):  # noqa: F811
    student, cache, corpus = tiny
    model, reader = _uniform_student(student), CacheReader(cache)
    targets = _targets(corpus, INDICES)
    assert (TABLE[targets] == 0).any()  # some predicted tokens are "special": bits counted, no bytes
    want = len(targets) * math.log2(VOCAB) / TABLE[targets].sum()
    for batch_size, chunk, table in ((4, None, TABLE), (1, 5, torch.from_numpy(TABLE)), (3, 7, TABLE.astype(np.int32))):
        got = evaluate_student(model, reader, INDICES, batch_size=batch_size, device="cpu", row_chunk=chunk,
                               token_bytes=table)
        assert got.ce == pytest.approx(math.log(VOCAB), rel=1e-6)
        assert got.bits_per_byte == pytest.approx(want, rel=1e-6)
    # The same bits over more bytes: special ids cost their bits whatever bytes the others have.
    ones = np.ones(VOCAB, dtype=np.int64)
    got = evaluate_student(model, reader, INDICES, batch_size=4, device="cpu", token_bytes=ones)
    assert got.bits_per_byte == pytest.approx(math.log2(VOCAB), rel=1e-6)
    assert evaluate_student(model, reader, INDICES, batch_size=4, device="cpu").bits_per_byte is None
    with pytest.raises(ValueError, match="token_bytes must be a 1-D array of non-negative integers"):
        evaluate_student(model, reader, INDICES, batch_size=4, device="cpu", token_bytes=TABLE.astype(np.float32))


def test_the_teachers_bits_per_byte_comes_from_target_logprob(tiny):  # noqa: F811
    _, cache, corpus = tiny
    ref = teacher_reference(CacheReader(cache), INDICES, token_bytes=TABLE)
    nats = -np.concatenate([corpus.targets[i].target_logprob[:-1] for i in INDICES]).astype(np.float64).sum()
    assert ref.bits_per_byte == pytest.approx(nats / math.log(2) / TABLE[_targets(corpus, INDICES)].sum(), rel=1e-6)
    assert teacher_reference(CacheReader(cache), INDICES).bits_per_byte is None
    # Cropped to 5 rows: the 5th predicts the 6th token where the sequence has one (the rows CE sums).
    cropped = teacher_reference(CacheReader(cache), INDICES, seq_len=5, token_bytes=TABLE)
    ends = {i: min(len(corpus.sequences[i]) - 1, 5) for i in INDICES}
    lp = np.concatenate([corpus.targets[i].target_logprob[:ends[i]] for i in INDICES]).astype(np.float64)
    crop_bytes = sum(TABLE[corpus.sequences[i][1:ends[i] + 1].astype(np.int64)].sum() for i in INDICES)
    assert cropped.bits_per_byte == pytest.approx(-lp.sum() / math.log(2) / crop_bytes, rel=1e-6)


def test_old_results_without_it_load_and_show_a_dash():
    old = {"kl": 0.5, "ce": 2.0, "ppl": 7.39, "top1": 0.4, "tokens": 10, "kind": "eval", "step": 3}
    before = EvalResult.from_dict(old)
    assert before.bits_per_byte is None and "bits_per_byte" not in before.to_dict()
    after = EvalResult(kl=0.2, ce=1.5, ppl=4.48, top1=0.6, tokens=10, bits_per_byte=1.234567)
    assert EvalResult.from_dict(after.to_dict()) == after and "1.2346 bits/byte" in after.summary()
    header, teacher_line, before_line, after_line, *notes = _eval_table(
        {"teacher": after, "before": before, "after": after}).splitlines()
    assert header.split()[-1] == "bits/byte" and before_line.split()[-1] == "-" and after_line.split()[-1] == "1.2346"
    assert "Bits/byte" + BITS_PER_BYTE_NOTE.removeprefix("bits_per_byte") in notes
    assert "bits/byte" not in _eval_table({"teacher": before, "after": before})  # no row has it: no column


def _run_dir(path, cache_id: str, **eval_row):
    """A run directory as the trainer leaves it, reduced to what `runs` / `compare` read."""
    path.mkdir()
    (path / "run.json").write_text(json.dumps({"cache_id": cache_id, "config": {"steps": 4, "lr": 0.01}}))
    row = {"kind": "eval", "step": 4, "kl": 0.25, "ce": 2.5, "ppl": 12.18, "top1": 0.5, "tokens": 96, **eval_row}
    (path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    return path


def test_compare_shows_bits_per_byte_across_caches_and_blanks_the_per_token_columns(tmp_path, capsys):
    a = _run_dir(tmp_path / "a", "a" * 16, bits_per_byte=1.1)
    b = _run_dir(tmp_path / "b", "b" * 16, bits_per_byte=0.9, kl=0.125)
    old = _run_dir(tmp_path / "old", "a" * 16)  # from before bits per byte
    assert read_run(old).eval["bits_per_byte"] is None and read_run(a).eval["bits_per_byte"] == 1.1
    code, out, err = run_cli(["compare", a, b], capsys)
    assert code == 0, err
    header, a_line, b_line = out.splitlines()[:3]
    assert header.split() == ["run", "cache", "at", "step", "held-out", "KL", "CE", "PPL", "top-1", "bits/byte", "status"]
    assert a_line.split()[2:] == ["4", "-", "-", "-", "-", "1.1000", "stopped"]
    assert b_line.split()[2:] == ["4", "-", "-", "-", "-", "0.9000", "stopped"]
    assert "--allow-different-caches shows them" in out
    code, out, _ = run_cli(["compare", a, b, "--allow-different-caches"], capsys)
    assert code == 0 and out.splitlines()[2].split()[3:5] == ["0.1250", "2.500"]
    code, _, err = run_cli(["compare", a, b, "--plot", tmp_path / "cmp"], capsys)
    assert "--allow-different-caches" in one_error_line(code, err) and not (tmp_path / "cmp.png").exists()
    code, out, _ = run_cli(["compare", a, old], capsys)  # one cache: every column, "-" for the old run's bits
    assert code == 0 and out.splitlines()[2].split()[1:] == ["4", "0.2500", "2.500", "12.18", "0.500", "-", "stopped"]
    code, out, _ = run_cli(["compare", a, b, "--json"], capsys)
    assert [r["eval"]["bits_per_byte"] for r in json.loads(out)] == [1.1, 0.9]
    code, out, _ = run_cli(["runs", tmp_path], capsys)
    header, *lines = out.splitlines()
    assert header.split()[header.split().index("top-1") + 1] == "bits/byte"
    assert [line.split()[0] for line in lines[:3]] == ["a", "b", "old"] and "1.1000" in lines[0] and " - " in lines[2]
    code, out, _ = run_cli(["runs", old], capsys)
    assert code == 0 and "bits/byte" not in out.splitlines()[0]  # no run recorded it: no column


def test_token_bytes_of_a_tokenizer_that_cannot_say_is_none_with_a_warning(tiny, teacher_dir, caplog):  # noqa: F811
    from transformers import AutoTokenizer

    with caplog.at_level(logging.WARNING, logger="student.evaluate"):
        assert token_bytes_of(tiny[0]) is None  # a word-level tokenizer
    assert "no bits per byte" in caplog.text and "byte-level" in caplog.text
    table = token_bytes_of(teacher_dir)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    assert table.dtype == np.int64 and len(table) == len(tokenizer)
    assert table[tokenizer.eos_token_id] == 0 and table[tokenizer.encode(" return")[0]] == len(b" return")
    assert (table == token_pieces(tokenizer).lengths).all()


def test_distill_eval_reports_bits_per_byte_of_student_and_teacher(tiny_student, tiny_cache, teacher_dir,  # noqa: F811
                                                                   capsys):
    """On a cache of the real byte-level tokenizer: the student's bits are its CE summed over the
    rows with a next token, the teacher's the cache's target log-probs, both over the bytes of the
    text those tokens decode to."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    code, out, err = run_cli(["eval", tiny_student, "--cache", tiny_cache, "--device", "cpu", "-q", "--json"], capsys)
    assert code == 0, err
    got = json.loads(out)
    reader = CacheReader(tiny_cache)
    sequences = [reader.sequence(i) for i in range(reader.num_sequences)]
    text_bytes = sum(len(tokenizer.decode(s.input_ids[1:].tolist()).encode("utf-8")) for s in sequences)
    ce_rows = got["student"]["tokens"] - len(sequences)
    assert got["student"]["bits_per_byte"] == pytest.approx(got["student"]["ce"] * ce_rows / math.log(2) / text_bytes,
                                                            rel=1e-5)
    teacher_nats = -sum(s.target_logprob[:-1].astype(np.float64).sum() for s in sequences)
    assert got["teacher"]["bits_per_byte"] == pytest.approx(teacher_nats / math.log(2) / text_bytes, rel=1e-5)
    assert got["bits_per_byte_note"] == BITS_PER_BYTE_NOTE
    code, out, err = run_cli(["eval", tiny_student, "--cache", tiny_cache, "--device", "cpu", "-q"], capsys)
    header, teacher_line, student_line = out.splitlines()[:3]
    assert header.split()[-1] == "bits/byte"
    assert student_line.split()[-1] == f"{got['student']['bits_per_byte']:.4f}"
    assert teacher_line.split()[-1] == f"{got['teacher']['bits_per_byte']:.4f}"


def test_eval_of_a_run_finds_its_tokenizer(tiny_student, tiny_cache, tmp_path):  # noqa: F811
    """A run's tokenizer folder is the one it trained with, else (moved away) its final student's."""
    from student.trainer import TrainConfig, train

    cfg = TrainConfig.from_flat(cache=str(tiny_cache), out=str(tmp_path / "run"), student=str(tiny_student), steps=1,
                                batch_size=2, heldout=2, lr=1e-3, warmup_steps=1, eval_every=0, save_every=0,
                                device="cpu")
    train(cfg, progress=False)
    result = evaluate_run_or_folder(tmp_path / "run", device="cpu")
    assert result["after"].bits_per_byte > result["teacher"].bits_per_byte > 0
    run_json = tmp_path / "run" / "run.json"
    run = json.loads(run_json.read_text())
    run["config"]["tokenizer"] = str(tmp_path / "moved")
    run_json.write_text(json.dumps(run))
    assert evaluate_run_or_folder(tmp_path / "run", device="cpu")["after"] == result["after"]
