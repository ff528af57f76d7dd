"""Cross-tokenizer distillation's data path (student/cross_tokenizer/): a cached sequence's bytes,
the alignment of two real tokenizations, the byte-prefix map against brute force, and the mapped
targets of the same tokenizer equal to the cache's own."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from student.cross_tokenizer.align import Aligner, special_map, special_roles
from student.cross_tokenizer.vocab_map import EMPTY_LOGPROB, VocabMap, longest_prefix_map, map_rows
from teacher_cache.token_bytes import token_pieces

sys.path.insert(0, str(Path(__file__).parent / "benchmarks"))
from bench_cross_tokenizer import train_bpe  # noqa: E402  (the benchmark's student tokenizer, smaller)

TEXTS = [
    "def f(x):\n    return x  # \u00e9 \U0001F600 \u00fcn\u00efcode\n",
    "import os\nprint('\u4e2d\u6587', os.sep)\n",
    "    \t\n\n  x = [1, 2, 3]  \u2192 \u00bd\n",
]


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(train_bpe(tmp_path_factory.mktemp("bpe") / "tok", 2000, files=60))


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(train_bpe(tmp_path_factory.mktemp("bytes") / "tok", 257, files=1))


def aligner(teacher, student):
    return Aligner(token_pieces(teacher), special_roles(teacher), token_pieces(student), student)


def teacher_ids(tokenizer, texts):
    """The texts tokenized by the teacher and joined by its EOS, as stage one packs documents."""
    ids = []
    for text in texts:
        if ids:
            ids.append(tokenizer.eos_token_id)
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return np.array(ids)


def test_pieces_spell_the_text(teacher_tokenizer, bpe_tokenizer, byte_tokenizer):
    for tok in (teacher_tokenizer, bpe_tokenizer, byte_tokenizer):
        pieces = token_pieces(tok)
        assert pieces.scheme == "byte_level"
        for text in TEXTS:
            assert pieces.decode(tok(text, add_special_tokens=False)["input_ids"]) == text.encode()
        assert pieces.special[tok.eos_token_id] and pieces.pieces[tok.eos_token_id] == b""


@pytest.mark.parametrize("student", ["bpe_tokenizer", "byte_tokenizer"])
def test_alignment_offsets_and_shared_boundaries(teacher_tokenizer, student, request):
    student = request.getfixturevalue(student)
    ids = teacher_ids(teacher_tokenizer, TEXTS)
    a = aligner(teacher_tokenizer, student).align(ids)
    t_pieces, s_pieces = token_pieces(teacher_tokenizer), token_pieces(student)
    # the student's tokens spell the same text, documents joined by the student's EOS
    eos_at = np.flatnonzero(a.student_ids == student.eos_token_id)
    assert len(eos_at) == len(TEXTS) - 1
    docs = np.split(a.student_ids, eos_at)
    assert [s_pieces.decode(d[d != student.eos_token_id]) for d in docs] == [t.encode() for t in TEXTS]
    # ends on the common axis: a text byte is one unit, a special token one
    units = lambda pieces, x: 1 if pieces.special[x] else len(pieces.pieces[x])
    assert (a.student_ends == np.cumsum([units(s_pieces, x) for x in a.student_ids])).all()
    assert (a.teacher_ends == np.cumsum([units(t_pieces, x) for x in ids])).all()
    # aligned exactly where both end at the same place; the EOS tokens align with each other
    for j, row in enumerate(a.teacher_row):
        hits = np.flatnonzero(a.teacher_ends == a.student_ends[j])
        assert row == (hits[0] if len(hits) else -1)
    assert (a.teacher_row[eos_at] == np.flatnonzero(ids == teacher_tokenizer.eos_token_id)).all()
    assert (a.teacher_row[-1] == len(ids) - 1) and not a.counts


def test_multibyte_characters_split_across_tokens(teacher_tokenizer, byte_tokenizer):
    text = "\U0001F600\u00e9"
    ids = teacher_ids(teacher_tokenizer, [text])
    a = aligner(teacher_tokenizer, byte_tokenizer).align(ids)
    assert len(a.student_ids) == len(text.encode())  # one byte a token
    # the byte student ends inside the emoji at bytes 1..3; the teacher's boundaries are shared
    assert set(a.teacher_ends) <= set(a.student_ends)
    assert (a.teacher_row >= 0).sum() == len(ids)


def test_invalid_bytes_at_a_window_edge(teacher_tokenizer, bpe_tokenizer):
    """A window that starts inside a character: the stray bytes become the student's byte tokens."""
    ids = teacher_ids(teacher_tokenizer, ["\U0001F600 x = 1\n"])
    pieces = token_pieces(teacher_tokenizer)
    cut = next(i for i in range(1, len(ids)) if pieces.pieces[ids[i]][:1] and pieces.pieces[ids[i]][0] & 0xC0 == 0x80)
    a = aligner(teacher_tokenizer, bpe_tokenizer).align(ids[cut:])
    assert token_pieces(bpe_tokenizer).decode(a.student_ids) == pieces.decode(ids[cut:])
    assert not a.counts and (a.teacher_row >= 0).any()


def test_invalid_bytes_a_student_cannot_encode_are_counted(teacher_tokenizer):
    from transformers import AutoTokenizer

    from pipelines.defaults import default_teacher_dir

    student = AutoTokenizer.from_pretrained(default_teacher_dir())
    al = aligner(teacher_tokenizer, student)
    al.byte_ids[0x80:0xC0] = -1  # a student without single-byte tokens for continuation bytes
    ids = teacher_ids(teacher_tokenizer, ["\U0001F600 ok"])
    pieces = token_pieces(teacher_tokenizer)
    cut = next(i for i in range(1, len(ids)) if pieces.pieces[ids[i]][0] & 0xC0 == 0x80)
    a = al.align(ids[cut:])
    assert a.counts["unencodable_bytes"] > 0 and len(a.student_ids) > 0


def test_specials_map_by_content_then_role(teacher_tokenizer, bpe_tokenizer):
    t, s = token_pieces(teacher_tokenizer), token_pieces(bpe_tokenizer)
    m = special_map(t, special_roles(teacher_tokenizer), s, special_roles(bpe_tokenizer))
    # SmolLM2-Instruct's EOS is <|im_end|> (2), which the student lacks: it maps by role; <|endoftext|>
    # (0) by content; <|im_start|> (1) and the rest map nowhere
    assert t.special_by_content["<|endoftext|>"] == 0 and teacher_tokenizer.eos_token_id == 2
    assert m == {0: bpe_tokenizer.eos_token_id, 2: bpe_tokenizer.eos_token_id}
    m = special_map(t, {"eos": 0}, s, {"eos": 5})
    assert m == {0: bpe_tokenizer.eos_token_id}  # content before role


def brute_force_targets(ids_k, lp_k, tail, teacher, student, specials):
    """The mapped distribution of one row as a dict {student id: prob} and the tail prob, by
    enumerating every student token and testing the byte-prefix relation."""
    dist, rest = {}, float(np.exp(tail))
    for v, lp in zip(ids_k, lp_k):
        best, best_len = None, 0
        if teacher.special[v]:
            best = specials.get(int(v))
        else:
            for s, piece in enumerate(student.pieces):
                if piece and not student.special[s] and teacher.pieces[v].startswith(piece) and len(piece) > best_len:
                    best, best_len = s, len(piece)
        if best is None:
            rest += float(np.exp(lp))
        else:
            dist[best] = dist.get(best, 0.0) + float(np.exp(lp))
    return dist, rest


def test_mapped_targets_equal_brute_force(teacher_tokenizer, bpe_tokenizer):
    t, s = token_pieces(teacher_tokenizer), token_pieces(bpe_tokenizer)
    specials = special_map(t, special_roles(teacher_tokenizer), s, special_roles(bpe_tokenizer))
    vmap = VocabMap(longest_prefix_map(t, s, specials), len(s))
    rng = np.random.default_rng(0)
    rows, k = 12, 16
    ids = np.stack([rng.choice(len(t), k, replace=False) for _ in range(rows)])
    ids[0, :3] = [0, 1, 2]  # specials: EOS (mapped) and two the student lacks (to the tail)
    probs = rng.dirichlet(np.ones(k + 1), rows)
    lp, tail = np.log(probs[:, :k]).astype(np.float32), np.log(probs[:, k]).astype(np.float32)
    out_ids, out_lp, out_tail = map_rows(vmap, ids, lp, tail, vmap.fillers)
    for r in range(rows):
        expect, rest = brute_force_targets(ids[r], lp[r], tail[r], t, s, specials)
        real = out_lp[r] > EMPTY_LOGPROB
        got = dict(zip(out_ids[r][real].tolist(), np.exp(out_lp[r][real].astype(np.float64)).tolist()))
        assert got.keys() == expect.keys()
        assert all(abs(got[key] - expect[key]) < 1e-6 for key in got)
        assert abs(np.exp(out_tail[r]) - rest) < 1e-6
        assert len(set(out_ids[r].tolist())) == k  # k distinct ids, fillers included
        assert not set(out_ids[r][~real].tolist()) & set(vmap.teacher_to_student.tolist())
        total = np.exp(out_lp[r].astype(np.float64)).sum() + np.exp(np.float64(out_tail[r]))
        assert abs(total - 1.0) < 1e-5


def test_identity_map_keeps_the_cache_rows():
    rng = np.random.default_rng(1)
    ids = np.stack([rng.choice(500, 8, replace=False) for _ in range(5)])
    lp = np.sort(np.log(rng.dirichlet(np.ones(9), 5)[:, :8]), 1)[:, ::-1].astype(np.float32)
    tail = rng.normal(size=5).astype(np.float32)
    identity = VocabMap(np.arange(500), 500)
    out = map_rows(identity, ids, lp, tail, identity.fillers)
    assert all(np.array_equal(a, b) for a, b in zip(out, (ids, lp, tail)))


def test_mapped_targets_feed_the_fused_loss(teacher_tokenizer, bpe_tokenizer):
    """Filler slots are neutral in the kernel: the loss over mapped targets equals the dense
    reference's with the fillers dropped from the targets (their P is 0) and the same gradient."""
    import kernels.fused_topk_kl as fused

    t, s = token_pieces(teacher_tokenizer), token_pieces(bpe_tokenizer)
    specials = special_map(t, special_roles(teacher_tokenizer), s, special_roles(bpe_tokenizer))
    vmap = VocabMap(longest_prefix_map(t, s, specials), len(s))
    rng = np.random.default_rng(2)
    rows, k, d = 6, 12, 8
    ids = np.stack([rng.choice(len(t), k, replace=False) for _ in range(rows)])
    probs = rng.dirichlet(np.ones(k + 1) * 0.5, rows)
    out_ids, out_lp, out_tail = map_rows(vmap, ids, np.log(probs[:, :k]).astype(np.float32),
                                         np.log(probs[:, k]).astype(np.float32), vmap.fillers)
    hidden = torch.randn(rows, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(len(s), d, dtype=torch.float64)
    loss = fused.fused_topk_kl(hidden, weight, torch.from_numpy(out_ids), torch.from_numpy(out_lp),
                               torch.from_numpy(out_tail), tail="bucket", impl="torch")
    (grad,) = torch.autograd.grad(loss, hidden)
    # by hand: KL over the real mapped ids + one tail category; the fillers are among the top-k ids,
    # so the student's tail excludes their q (P = 0 there pushes it down)
    logq = torch.log_softmax(hidden @ weight.T, -1)
    total = 0
    for r in range(rows):
        real = out_lp[r] > EMPTY_LOGPROB
        p = torch.from_numpy(np.exp(out_lp[r][real].astype(np.float64)))
        q_ids = torch.from_numpy(out_ids[r])
        p_tail = float(np.exp(np.float64(out_tail[r])))
        q_tail = 1 - logq[r, q_ids].exp().sum()
        total = total + (p * (p.log() - logq[r, q_ids[torch.from_numpy(real)]])).sum() + p_tail * (
            np.log(p_tail) - q_tail.log())
    ref = total / rows
    (ref_grad,) = torch.autograd.grad(ref, hidden)
    # the kernel renormalises top-k + tail, stored in fp32, to sum to one: equal to fp32 rounding
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)


def _toy_batch(rows=10, k=4, vocab=23, seed=3):
    from student.data import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(rows)])
    probs = torch.distributions.Dirichlet(torch.ones(k + 1)).sample((rows,))
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[-1] = -1
    mask = torch.ones(rows, dtype=torch.bool)
    mask[-2] = False
    kd = torch.tensor([True, False, True, True, False, False, True, True, False, True])
    return Batch(torch.zeros(1, rows, dtype=torch.long), ids, probs[:, :k].log(), probs[:, k].log(), target,
                 torch.full((rows,), float("nan")), mask, None, kd)


def test_loss_of_a_cross_tokenizer_batch_by_hand():
    """KL (bucket) over the aligned rows, CE over the unaligned rows (and at ce_weight over the
    aligned ones), each as written out with dense logits."""
    from student.loss import LossConfig, distill_loss

    batch = _toy_batch()
    hidden = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(23, 6, dtype=torch.float64)
    logq = torch.log_softmax(hidden @ weight.T, -1)
    p, p_tail = batch.topk_logprobs.exp().double(), batch.tail_logmass.exp().double()
    q = logq.gather(1, batch.topk_ids).exp()
    kl_rows = (p * (p.log() - q.log())).sum(1) + p_tail * (p_tail.log() - (1 - q.sum(1)).log())
    kd = batch.kd_rows
    has = batch.mask & (batch.target_ids >= 0)
    ce_rows = -logq.gather(1, batch.target_ids.clamp_min(0)[:, None])[:, 0]
    kl = kl_rows[kd].mean()
    # the unaligned rows' CE at full weight, the aligned rows' at w, over every row with a next token
    ce = lambda w: (w * ce_rows[has & kd].sum() + ce_rows[has & ~kd].sum()) / has.sum()
    for w in (0.0, 0.3, 1.0):
        loss, kl_metric = distill_loss(hidden, weight, batch, LossConfig(ce_weight=w), cache_temperature=1.0)
        torch.testing.assert_close(loss, (1 - w) * kl + ce(w))
        torch.testing.assert_close(kl_metric, kl.detach())
        (grad,) = torch.autograd.grad(loss, hidden)
        (want,) = torch.autograd.grad((1 - w) * kl + ce(w), hidden, retain_graph=True)
        torch.testing.assert_close(grad, want)
    torch.testing.assert_close(ce(1.0), ce_rows[has].mean())  # w = 1: cross-entropy alone
