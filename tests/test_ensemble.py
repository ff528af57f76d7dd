"""Teacher ensembles (student/ensemble.py): the combined top-k + tail against a brute-force mixture
per row, an ensemble of one teacher equal to that teacher, rows that sum to one, the fused loss's
optimum at the mixture, and the one-line errors of bad options."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distill.errors import DistillUserError
from kernels.fused_topk_kl import fused_topk_kl
from student.cross_tokenizer.vocab_map import EMPTY_LOGPROB
from student.ensemble import combine_topk
from teacher_cache.targets import tail_logmass_from_topk

V, N = 40, 64


def _teachers(ks, seed=0, n=N, v=V):
    """Teachers' cached top-k_i of the same rows, as the cache holds them (descending order, tail from
    the top-k): partly shared logits, so the top-k lists overlap without being equal; some rows so
    sharp that the top-k holds all the mass (the tail at the cache's floor). The last teacher's
    every third row ends in a filler slot (an id outside its top-k at EMPTY_LOGPROB), as
    cross-tokenizer targets hold them."""
    rng = np.random.default_rng(seed)
    shared = rng.normal(size=(n, v))
    sharpness = rng.choice([1.0, 3.0, 60.0], size=(n, 1), p=[0.45, 0.45, 0.1])
    parts = []
    for k_i in ks:
        logits = (shared + rng.normal(size=(n, v))) * sharpness
        lp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        ids = np.argsort(-lp, 1)[:, :k_i]
        top = np.take_along_axis(lp, ids, 1).astype(np.float32)
        parts.append([ids.astype(np.int32), top, tail_logmass_from_topk(top)])
    ids, top, _ = parts[-1]
    for r in range(0, n, 3):
        ids[r, -1] = next(i for i in range(v) if i not in ids[r])
        top[r, -1] = EMPTY_LOGPROB
    parts[-1][2] = tail_logmass_from_topk(top)
    return [tuple(part) for part in parts]


def _reference(parts, weights, k, v=V):
    """The mixture per row with a dict: (ids [N, k], probabilities [N, k], tail mass [N])."""
    w = [x / sum(weights) for x in weights]
    out_ids, out_p, out_tail = [], [], []
    for r in range(len(parts[0][0])):
        mix: dict[int, float] = {}
        for (ids, lp, _), w_i in zip(parts, w):
            for i, l in zip(ids[r].tolist(), lp[r].tolist()):
                mix[i] = mix.get(i, 0.0) + w_i * math.exp(l)
        kept = sorted(mix.items(), key=lambda item: (-item[1], item[0]))[:k]
        fillers = [i for i in range(v) if i not in mix][:k - len(kept)]
        out_ids.append([i for i, _ in kept] + fillers)
        out_p.append([p for _, p in kept] + [0.0] * len(fillers))
        out_tail.append(1.0 - sum(p for _, p in kept))
    return np.array(out_ids), np.array(out_p), np.array(out_tail)


@pytest.mark.parametrize("k", [1, 4, 12, 20])  # unions hold 9 to 16 ids: 12 fills some rows, 20 all
def test_combine_matches_brute_force_mixture(k):
    parts = _teachers([3, 5, 8])
    weights = [0.5, 2.0, 1.3]
    ids, lp, tail = combine_topk(parts, weights, k)
    ref_ids, ref_p, ref_tail = _reference(parts, weights, k)
    assert ids.dtype == np.int64 and lp.dtype == np.float32 and tail.dtype == np.float32
    assert ids.shape == lp.shape == (N, k) and tail.shape == (N,)
    np.testing.assert_array_equal(ids, ref_ids)
    ref_lp = np.where(ref_p > 0, np.log(np.where(ref_p > 0, ref_p, 1.0)), EMPTY_LOGPROB)
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.exp(tail.astype(np.float64)), np.maximum(ref_tail, 1e-12), rtol=1e-5, atol=1e-8)
    assert (np.diff(lp, axis=1) <= 0).all()
    assert all(len(set(row)) == k for row in ids.tolist())
    if k == 20:
        assert (lp == EMPTY_LOGPROB).any(axis=1).all()


def test_ties_keep_the_smaller_id():
    """Equal mixed probabilities across the cut at k: the smaller ids are kept, whatever the slot order."""
    rng = np.random.default_rng(5)
    parts = []
    for _ in range(2):
        ids = np.stack([rng.permutation(V)[:12] for _ in range(8)])
        lp = np.full((8, 12), math.log(1 / 16), np.float32)
        parts.append((ids, lp, tail_logmass_from_topk(lp)))
    ids, lp, tail = combine_topk(parts, [1.0, 1.0], 7)
    ref_ids, ref_p, _ = _reference(parts, [1.0, 1.0], 7)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(np.exp(lp), ref_p, rtol=1e-6)


def test_ensemble_of_one_teacher_is_that_teacher():
    (ids, lp, tail), = _teachers([7], seed=1)
    for weights in ([1.0, 1.0], [0.3, 1.7]):
        out_ids, out_lp, out_tail = combine_topk([(ids, lp, tail), (ids, lp, tail)], weights, 7)
        np.testing.assert_array_equal(out_ids, ids)
        np.testing.assert_allclose(out_lp, lp, rtol=0, atol=1e-6)
        np.testing.assert_allclose(out_tail, tail, rtol=1e-6, atol=1e-6)


def test_weight_zero_teacher_adds_nothing():
    a, b = _teachers([4, 6], seed=2)
    out = combine_topk([a, b], [2.0, 0.0], 4)
    np.testing.assert_array_equal(out[0], a[0])
    np.testing.assert_allclose(out[1], a[1], rtol=0, atol=1e-6)
    np.testing.assert_allclose(out[2], a[2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k", [2, 6, 16, 25])
def test_combined_rows_sum_to_one(k):
    _, lp, tail = combine_topk(_teachers([3, 8, 5], seed=3), [1.0, 0.2, 3.0], k)
    total = np.exp(lp.astype(np.float64)).sum(1) + np.exp(tail.astype(np.float64))
    np.testing.assert_allclose(total, 1.0, rtol=0, atol=2e-6)


def test_fused_loss_optimum_is_the_mixture():
    v, k = 13, 4  # teachers' k_i 3 and 5: every union has >= 5 ids, so no fillers and no zero-probability id
    ids, lp, tail = combine_topk(_teachers([3, 5], seed=4, v=v), [0.7, 0.4], k)
    p_kept = np.exp(lp.astype(np.float64))
    q = np.repeat(np.exp(tail.astype(np.float64))[:, None] / (v - k), v, axis=1)  # tail spread evenly
    np.put_along_axis(q, ids, p_kept, axis=1)
    logits = torch.tensor(np.log(q), dtype=torch.float32)
    teacher = (torch.from_numpy(ids), torch.from_numpy(lp), torch.from_numpy(tail))

    def kl(hidden):  # weight = identity: the student's logits are `hidden`
        _, kl_N = fused_topk_kl(hidden, torch.eye(v), *teacher, tail="bucket", reduction="none", impl="torch",
                                return_kl=True)
        return kl_N

    assert kl(logits).abs().max() < 1e-5
    perturbed = logits + 0.5 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
    assert kl(perturbed).min() > 1e-3


@pytest.mark.parametrize("weights, k, option", [
    ([1.0], 3, "--ensemble-weights"),
    ([1.0, 1.0, 1.0], 3, "--ensemble-weights"),
    ([1.0, -0.5], 3, "--ensemble-weights"),
    ([0.0, 0.0], 3, "--ensemble-weights"),
    ([1.0, float("nan")], 3, "--ensemble-weights"),
    ([1.0, 1.0], 0, "--ensemble-k"),
    ([1.0, 1.0], 2.5, "--ensemble-k"),
])
def test_bad_options_refused_in_one_line(weights, k, option):
    with pytest.raises(DistillUserError, match=option) as error:
        combine_topk(_teachers([3, 4], n=5), weights, k)
    assert "\n" not in str(error.value)


# --- EnsembleBatches: the caches of two teachers over one corpus -------------------------------------


def _second_teacher(corpus, seed: int = 5):
    """The same text scored by another teacher: each row's distribution moved to other ids (a fixed
    permutation of the vocabulary), with the sampled next tokens' log-probs where they now fall."""
    from dataclasses import replace

    from test_cache_synth import SynthCorpus

    perm = np.random.default_rng(seed).permutation(300)
    full = corpus.full_logprobs[:, np.argsort(perm)]  # p'(perm[v]) = p(v)
    targets, start = [], 0
    for ids, t in zip(corpus.sequences, corpus.targets):
        rows = full[start:start + len(ids)]
        target = np.full(len(ids), np.nan, np.float32)
        target[:-1] = rows[np.arange(len(ids) - 1), ids[1:]]
        targets.append(replace(t, topk_ids=perm[t.topk_ids].astype(np.int32), target_logprob=target))
        start += len(ids)
    return SynthCorpus(corpus.sequences, targets, full)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    from test_cache_synth import make_corpus, write_cache

    root = tmp_path_factory.mktemp("ensemble")
    corpus = make_corpus(num_seqs=10, seq_len=20, seed=4)
    write_cache(root / "a", corpus, shard_size=4)
    write_cache(root / "b", _second_teacher(corpus), shard_size=3)  # another shard layout: rows found by sequence
    write_cache(root / "other", make_corpus(num_seqs=10, seq_len=20, seed=9), shard_size=4, data__fingerprint="f9")
    return root, corpus


def _ensemble(root, names, weights, k=8, **kwargs):
    from student.ensemble import EnsembleBatches
    from teacher_cache.reader import CacheReader

    first, *others = (CacheReader(root / name) for name in names)
    return EnsembleBatches(first, range(10), 3, others=others, weights=weights, k=k, seed=2, **kwargs)


def test_an_ensemble_of_one_cache_twice_reads_as_that_cache(teachers):
    from student.data import CacheBatches
    from teacher_cache.reader import CacheReader

    root, _ = teachers
    plain = CacheBatches(CacheReader(root / "a"), range(10), 3, seed=2, seq_len=9)
    for want, got, _ in zip(plain, _ensemble(root, ["a", "a"], [0.3, 0.7], seq_len=9), range(5)):
        assert torch.equal(want.topk_ids, got.topk_ids) and torch.equal(want.mask, got.mask)
        torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs, rtol=0, atol=2e-6)
        torch.testing.assert_close(got.tail_logmass, want.tail_logmass, rtol=0, atol=2e-6)
        torch.testing.assert_close(got.target_logprob, want.target_logprob, rtol=0, atol=2e-6, equal_nan=True)


def test_an_ensembles_rows_are_the_mixture_of_both_teachers(teachers):
    root, corpus = teachers
    second = _second_teacher(corpus)
    data = _ensemble(root, ["a", "b"], [1.0, 3.0], k=12)
    batch = next(iter(data))
    picked = data.epoch_order(0)[:3]
    starts = np.cumsum([0] + [len(s) for s in corpus.sequences])
    B, L = batch.input_ids.shape
    for b, i in enumerate(picked):
        for t in range(len(corpus.sequences[i])):
            row = b * L + t
            mix = 0.25 * np.exp(corpus.full_logprobs[starts[i] + t]) + 0.75 * np.exp(second.full_logprobs[starts[i] + t])
            ids = batch.topk_ids[row].numpy()
            kept = batch.topk_logprobs[row].numpy() > EMPTY_LOGPROB
            # each kept id's mass is its share of the mixture from the teachers whose top-8 hold it
            in_a = np.isin(ids, corpus.targets[i].topk_ids[t])
            in_b = np.isin(ids, second.targets[i].topk_ids[t])
            want = 0.25 * np.exp(corpus.full_logprobs[starts[i] + t, ids]) * in_a + \
                0.75 * np.exp(second.full_logprobs[starts[i] + t, ids]) * in_b
            np.testing.assert_allclose(np.exp(batch.topk_logprobs[row].numpy())[kept], want[kept], rtol=2e-5, atol=1e-7)
            if t + 1 < len(corpus.sequences[i]):
                nxt = corpus.sequences[i][t + 1]
                assert batch.target_logprob[row].item() == pytest.approx(math.log(mix[nxt]), rel=1e-5)


def test_caches_of_another_corpus_name_the_fingerprint_and_the_first_differing_sequence(teachers):
    from student.ensemble import check_same_corpus
    from teacher_cache.reader import CacheReader

    root, _ = teachers
    check_same_corpus(CacheReader(root / "a"), CacheReader(root / "b"))  # one corpus: no error
    with pytest.raises(DistillUserError, match="--ensemble") as error:
        check_same_corpus(CacheReader(root / "a"), CacheReader(root / "other"))
    assert "f9" in str(error.value) and "first differing sequence 0" in str(error.value)


def test_ensemble_batches_built_on_several_threads_come_in_order(teachers):
    from student.data import Prefetcher

    root, _ = teachers
    want = [b for b, _ in zip(_ensemble(root, ["a", "b"], [1.0, 1.0]), range(7))]  # past the first epoch
    with Prefetcher(_ensemble(root, ["a", "b"], [1.0, 1.0]), workers=3) as stream:
        for batch in want:
            got = next(stream)
            for x, y in zip(vars(batch).values(), vars(got).values()):
                if x is not None:
                    torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


# --- sampled and hybrid caches: every teacher's weighted draws ----------------------------------------


def _sampled_parts(ks, seed=0, n=N, v=V):
    """Per teacher (ids [n, k_i], log-probs, slot weights) as student.data.target_weights gives a sampled
    row: k_i draws from the teacher, unique ids with weight count / k_i, padding slots (weight 0) after."""
    rng = np.random.default_rng(seed)
    parts = []
    for k_i in ks:
        logits = rng.normal(size=(n, v)) * 2
        lp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        ids, out_lp, weights = np.zeros((n, k_i), np.int64), np.zeros((n, k_i), np.float32), np.zeros((n, k_i))
        for r in range(n):
            drawn, counts = np.unique(rng.choice(v, size=k_i, p=np.exp(lp[r])), return_counts=True)
            pad = [i for i in range(v) if i not in drawn][:k_i - len(drawn)]
            ids[r] = np.concatenate([drawn, pad])
            out_lp[r] = lp[r, ids[r]]
            weights[r, :len(drawn)] = counts / k_i
        parts.append((ids, out_lp, weights.astype(np.float32)))
    return parts


@pytest.mark.parametrize("ks", [(6, 6), (4, 9, 5)])
def test_combine_sampled_keeps_every_teachers_draws_at_its_weight(ks):
    from student.ensemble import combine_sampled

    parts, weights = _sampled_parts(ks), [1.0, 3.0, 0.0][:len(ks)] if len(ks) == 3 else [1.0, 3.0]
    w = np.array(weights) / sum(weights)
    ids, lp, slot_w = combine_sampled(parts, weights)
    assert ids.shape == (N, sum(ks)) and lp.shape == ids.shape and slot_w.shape == ids.shape
    for r in range(N):
        assert len(set(ids[r].tolist())) == ids.shape[1]  # distinct ids, fillers included
        want_w, want_wl = {}, {}
        for (p_ids, p_lp, p_w), w_i in zip(parts, w):
            for i, l, x in zip(p_ids[r].tolist(), p_lp[r].tolist(), p_w[r].tolist()):
                if x * w_i > 0:
                    want_w[i] = want_w.get(i, 0.0) + w_i * x
                    want_wl[i] = want_wl.get(i, 0.0) + w_i * x * l
        got = {i: (x, l) for i, x, l in zip(ids[r].tolist(), slot_w[r].tolist(), lp[r].tolist()) if x > 0}
        assert sorted(got) == sorted(want_w)
        for i, (x, l) in got.items():
            assert x == pytest.approx(want_w[i], rel=1e-6) and l == pytest.approx(want_wl[i] / want_w[i], rel=1e-5)
        assert slot_w[r].sum() == pytest.approx(1.0, rel=1e-5)  # each teacher's draws weigh 1, the mixture too


def test_a_sampled_ensembles_loss_and_gradient_are_the_teachers_weighted_sum():
    """The loss's estimate over the merged slots is sum_i w_i KL_est_i exactly, so its gradient is the
    weighted sum of each teacher's: unbiased for the gradient of KL(mixture || student)."""
    from student.ensemble import combine_sampled

    parts, w = _sampled_parts((7, 5), seed=3), (0.3, 0.7)
    ids, lp, slot_w = combine_sampled(parts, w)
    mask = torch.ones(N, dtype=torch.bool)

    def loss_and_grad(ids, lp, weights):
        hidden = torch.from_numpy(np.random.default_rng(11).normal(size=(N, V))).float().requires_grad_()
        loss = fused_topk_kl(hidden, torch.eye(V), torch.as_tensor(ids), torch.as_tensor(lp), torch.zeros(N),
                             mask=mask, tail="unnormalized", reduction="sum", impl="torch",
                             target_weights=torch.as_tensor(weights))
        loss.backward()
        return loss.item(), hidden.grad

    ens_loss, ens_grad = loss_and_grad(ids, lp, slot_w)
    each = [loss_and_grad(*part) for part in parts]
    assert ens_loss == pytest.approx(sum(w_i * l for w_i, (l, _) in zip(w, each)), rel=1e-5)
    torch.testing.assert_close(ens_grad, sum(w_i * g for w_i, (_, g) in zip(w, each)), rtol=1e-5, atol=1e-6)


def _sampled_corpus(corpus, samples: int, seed: int):
    """`corpus` (test_cache_synth) with sampled targets: `samples` draws a row from its full distribution."""
    from dataclasses import replace

    from test_cache_synth import SynthCorpus

    rng = np.random.default_rng(seed)
    vocab, targets, start = corpus.full_logprobs.shape[1], [], 0
    for t in corpus.targets:
        n = t.num_positions
        ids, lp, counts = np.zeros((n, samples), np.int32), np.zeros((n, samples), np.float32), np.zeros((n, samples), np.uint8)
        for r in range(n):
            full = corpus.full_logprobs[start + r]
            drawn, c = np.unique(rng.choice(vocab, size=samples, p=np.exp(full) / np.exp(full).sum()), return_counts=True)
            ids[r] = np.concatenate([drawn, [i for i in range(vocab) if i not in drawn][:samples - len(drawn)]])
            lp[r], counts[r, :len(drawn)] = full[ids[r]], c
        tail = tail_logmass_from_topk(np.where(counts > 0, lp, -np.inf).astype(np.float32))
        targets.append(replace(t, topk_ids=ids, topk_logprobs=lp, tail_logmass=tail, sample_counts=counts))
        start += n
    return SynthCorpus(corpus.sequences, targets, corpus.full_logprobs)


def write_sampled_cache(path, corpus, samples: int, seed: int, **spec):
    from test_cache_synth import write_cache

    return write_cache(path, _sampled_corpus(corpus, samples, seed), targets__kind="sampled", targets__k=samples,
                       targets__samples=samples, targets__proposal_temperature=1.0, targets__seed=seed, **spec)


def test_an_ensemble_of_sampled_caches_reads_each_caches_weights_merged(teachers, tmp_path):
    from student.data import CacheBatches
    from student.ensemble import EnsembleBatches, combine_sampled
    from teacher_cache.reader import CacheReader

    root, corpus = teachers
    write_sampled_cache(tmp_path / "s1", corpus, 6, seed=1, shard_size=4)
    write_sampled_cache(tmp_path / "s2", _second_teacher(corpus), 5, seed=2, shard_size=3)
    a, b = CacheReader(tmp_path / "s1"), CacheReader(tmp_path / "s2")
    data = EnsembleBatches(a, range(10), 3, others=[b], weights=[1.0, 3.0], k=11, seed=2)
    picked = [(0, i) for i in data.epoch_order(0)[:3]]
    got = data.make_batch(picked)
    each = [CacheBatches(r, range(10), 3).make_batch(picked) for r in (a, b)]  # the same sequences, whole
    rows = got.mask
    want = combine_sampled([(e.topk_ids[rows].numpy(), e.topk_logprobs[rows].numpy(), e.target_weights[rows].numpy())
                            for e in each], [0.25, 0.75])
    for x, y in zip((got.topk_ids[rows], got.topk_logprobs[rows], got.target_weights[rows]), want):
        np.testing.assert_array_equal(x.numpy(), y)
    assert (got.target_weights[~rows] == 0).all()


def test_top_k_and_sampled_caches_in_one_ensemble_are_refused_in_one_line(teachers, tmp_path):
    from student.ensemble import check_ensemble_kinds, ensemble_width
    from teacher_cache.reader import CacheReader

    root, corpus = teachers
    write_sampled_cache(tmp_path / "s", corpus, 6, seed=1)
    with pytest.raises(DistillUserError, match="--ensemble: .* top-k and sampled caches cannot be combined") as error:
        check_ensemble_kinds(CacheReader(root / "a"), CacheReader(tmp_path / "s"))
    assert "\n" not in str(error.value)
    sampled = [CacheReader(tmp_path / "s")] * 2
    assert ensemble_width(sampled, None) == 12 and ensemble_width([CacheReader(root / "a")] * 2, None) == 8
    with pytest.raises(DistillUserError, match="--ensemble-k: an ensemble of sampled caches keeps every drawn id"):
        ensemble_width(sampled, 6)
