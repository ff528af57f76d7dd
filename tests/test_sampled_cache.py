"""Sampled teacher targets (RS-KD, issue 20): the draws, the cache that stores them, its manifest,
reader, verify and cache-stats, determinism, a statistical check against the tiny teacher's own
distribution, and the slot weights stage two trains with (student.data)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import run_cli, run_cli_ok
from kernels.sample_targets import sample_targets
from student.data import CacheBatches, target_weights
from teacher_cache.manifest import Manifest, load_manifest
from teacher_cache.reader import CacheReader
from teacher_cache.targets import Sampling, TeacherTargets
from teacher_cache.verify import verify_cache

FIXTURES = Path(__file__).parent / "fixtures"
# 7 sequences of 32 tokens in shards of 2: 4 shards, the last one short. T = 0.02 makes the tiny
# random teacher's distribution that of a language model (entropy ~4 nats, top-1 ~0.3).
SMALL = ["--max-sequences", "7", "--seq-len", "32", "--shard-size", "2", "--temperature", "0.02", "-q"]
SAMPLED = ["--targets", "sampled", "--samples", "12", "--codec", "fp32"]


def _build(tiny_teacher, out, *extra, capsys=None):
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL, *SAMPLED, *extra], capsys)
    assert code == 0, err
    return out


def _shards(cache: Path) -> tuple[str, list[tuple[str, str]]]:
    manifest = json.loads((cache / "manifest.json").read_text())
    return manifest["cache_id"], [(s["name"], s["checksum"]) for s in manifest["shards"]]


def _sequences(cache: Path) -> list:
    reader = CacheReader(cache)
    return [reader.sequence(i) for i in range(len(reader))]


@pytest.fixture(scope="module")
def sampled_cache(tmp_path_factory, tiny_teacher):
    out = tmp_path_factory.mktemp("sampled") / "cache"
    run_cli_ok(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL, *SAMPLED])
    return out


# --- the draws (kernels/sample_targets.py) ---


def _rows(seed=0, n=64, d=8, v=97, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * scale, torch.randn(v, d, generator=g)


@pytest.mark.parametrize("proposal", [None, 0.7])
def test_draws_are_cache_slots(proposal):
    hidden, weight = _rows()
    S, T = 12, 1.3
    uniforms = torch.from_numpy(np.random.default_rng(0).random((64, S)))
    next_ids = torch.randint(0, 97, (64,))
    next_ids[-1] = -1
    ids, lp, tail, target, counts, prop = sample_targets(hidden, weight, uniforms, next_ids, temperature=T,
                                                         proposal_temperature=proposal)
    ids, counts = ids.long(), counts.long()
    assert (counts.sum(1) == S).all()
    assert all(len(set(row.tolist())) == S for row in ids)  # distinct, padding included
    drawn = counts > 0
    assert (drawn[:, :-1] >= drawn[:, 1:]).all()  # drawn slots first
    key = (S - counts) * 97 + ids
    assert (key[:, :-1] < key[:, 1:]).all()  # count descending, then id ascending; padding likewise
    for row in range(64):  # padding: the smallest ids not drawn
        free = [v for v in range(97) if v not in set(ids[row][drawn[row]].tolist())]
        assert ids[row][~drawn[row]].tolist() == free[:S - int(drawn[row].sum())]
    full = torch.log_softmax(hidden @ weight.T / T, -1)
    torch.testing.assert_close(lp, full.gather(1, ids))
    mass = (lp.exp() * drawn).sum(1).double()
    torch.testing.assert_close(tail.double(), torch.log1p(-mass), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(target[:-1], full[torch.arange(63), next_ids[:-1]])
    assert torch.isnan(target[-1])
    if proposal is None:
        assert prop is None
    else:
        torch.testing.assert_close(prop, torch.log_softmax(hidden @ weight.T / proposal, -1).gather(1, ids))
    # chunks of rows draw the same ids (the matmul of another shape may round the logits differently)
    again = sample_targets(hidden, weight, uniforms, next_ids, temperature=T, proposal_temperature=proposal,
                           chunk_size=5)
    assert torch.equal(again[0], ids.int()) and torch.equal(again[4], counts.to(torch.uint8))
    for a, b in zip((lp, tail, target, prop), (again[1], again[2], again[3], again[5])):
        assert a is b is None or torch.allclose(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("proposal", [None, 0.6, 2.5])
def test_slot_weights_are_unbiased_for_the_teacher(proposal):
    """E[sum of weights at id v] = p(v) for every v: the estimator the loss relies on."""
    hidden, weight = _rows(seed=1, n=1, d=8, v=40, scale=1.0)
    N, S, T = 4000, 8, 0.8
    uniforms = torch.from_numpy(np.random.default_rng(1).random((N, S)))
    out = sample_targets(hidden.expand(N, -1).contiguous(), weight, uniforms, temperature=T,
                         proposal_temperature=proposal)
    targets = TeacherTargets(*(None if t is None else t.numpy() for t in out))
    w = target_weights(targets).astype(np.float64)
    per_id = np.zeros((N, 40))
    np.add.at(per_id, (np.repeat(np.arange(N), S), targets.topk_ids.reshape(-1)), w.reshape(-1))
    logits = (hidden @ weight.T)[0].double()
    p = torch.softmax(logits / T, -1).numpy()
    r = torch.softmax(logits / (proposal or T), -1).numpy()
    # Per row the weight at v is (c_v / S) p(v) / r(v) with c_v ~ Binomial(S, r(v)).
    stderr = p / r * np.sqrt(r * (1 - r) / (S * N))
    assert (np.abs(per_id.mean(0) - p) <= 5 * stderr + 1e-6).all()
    if proposal is None:
        np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-6)


def test_uniforms_of_a_block_of_rows_equal_those_of_the_whole_sequence():
    sampling = Sampling(samples=7, proposal_temperature=1.0, seed=3)
    whole = sampling.uniforms(5, 0, 40)
    for start, stop in ((0, 1), (1, 3), (3, 40), (17, 29)):
        np.testing.assert_array_equal(sampling.uniforms(5, start, stop), whole[start:stop])
    assert not np.array_equal(Sampling(7, 1.0, seed=4).uniforms(5, 0, 40), whole)
    assert not np.array_equal(sampling.uniforms(6, 0, 40), whole)


@pytest.mark.parametrize("codec", ["sqrt8", "bf16"])
def test_any_codec_keeps_counts_with_their_ids(codec):
    """sqrt8 stores ids ascending and decodes them by probability: the counts must follow their ids."""
    from teacher_cache.codecs import get_codec
    from teacher_cache.store import decode_shard, encode_shard

    hidden, weight = _rows(seed=2, n=40, v=61)
    out = sample_targets(hidden, weight, torch.from_numpy(np.random.default_rng(2).random((40, 9))),
                         temperature=1.0, proposal_temperature=1.7)
    targets = TeacherTargets(*(None if t is None else t.numpy() for t in out))
    arrays = encode_shard([np.zeros(25, np.int32), np.zeros(15, np.int32)], targets, get_codec(codec))
    _, _, back = decode_shard(arrays, get_codec(codec), "x")
    for name in ("topk_ids", "sample_counts", "proposal_logprobs", "tail_logmass"):
        np.testing.assert_array_equal(getattr(back, name), getattr(targets, name), err_msg=name)
    np.testing.assert_allclose(np.exp(back.topk_logprobs), np.exp(targets.topk_logprobs), atol=4e-3)


def test_a_long_sequence_prefilled_in_chunks_draws_as_one_forward(tiny_teacher):
    from teacher_cache.backends.hf import HFBackend

    seq = np.random.default_rng(0).integers(0, 49152, 40)
    sampling = Sampling(samples=6, proposal_temperature=0.02, seed=5)
    whole, chunked = (HFBackend(tiny_teacher, dtype="float32", device="cpu", temperature=0.02, prefill_tokens=p)
                      .score([seq], 6, sampling=sampling, indices=[3])[0] for p in (64, 16))
    np.testing.assert_array_equal(chunked.topk_ids, whole.topk_ids)
    np.testing.assert_array_equal(chunked.sample_counts, whole.sample_counts)
    np.testing.assert_allclose(chunked.topk_logprobs, whole.topk_logprobs, atol=1e-4)


# --- statistics against the tiny teacher's own distribution ---


@pytest.mark.parametrize("proposal", [None, 0.03])
def test_draws_follow_the_teachers_distribution(tiny_teacher, proposal):
    """Over 256 positions x 64 draws, the draws' rank bins match the proposal's probabilities
    (Pearson chi-square at p = 0.001); drawing at 0.022 instead of 0.02 fails it."""
    from scipy.stats import chi2
    from transformers import AutoModelForCausalLM

    from teacher_cache.backends.hf import HFBackend

    T, S = 0.02, 64
    backend = HFBackend(tiny_teacher, dtype="float32", device="cpu", temperature=T, batch_size=2)
    seqs = [np.random.default_rng(i).integers(0, backend.vocab_size, 64) for i in range(4)]
    sampling = Sampling(samples=S, proposal_temperature=T if proposal is None else proposal, seed=0)
    got = TeacherTargets.concat(backend.score(seqs, S, sampling=sampling, indices=[0, 1, 2, 3]))
    backend.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_teacher, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = torch.cat([model(torch.from_numpy(s)[None]).logits[0] for s in seqs]).double()
    teacher = torch.log_softmax(logits / T, -1)
    ids = torch.from_numpy(got.topk_ids).long()
    torch.testing.assert_close(torch.from_numpy(got.topk_logprobs).double(), teacher.gather(1, ids), atol=2e-4,
                               rtol=0)
    drawn_from = teacher if proposal is None else torch.log_softmax(logits / proposal, -1)
    if proposal is not None:
        torch.testing.assert_close(torch.from_numpy(got.proposal_logprobs).double(), drawn_from.gather(1, ids),
                                   atol=2e-4, rtol=0)
    probs = drawn_from.exp()
    order = probs.argsort(dim=1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(probs.shape[1]).expand_as(order))
    edges = torch.tensor([1, 2, 4, 8, 16, 64, probs.shape[1]])  # rank bins [0,1), [1,2), [2,4), ...
    expected = torch.stack([probs.gather(1, order[:, lo:hi]).sum(1) for lo, hi in
                            zip([0, *edges[:-1].tolist()], edges.tolist())], 1).sum(0) * S
    drawn_rank = rank.gather(1, ids)
    bins = torch.bucketize(drawn_rank, edges, right=True)
    observed = torch.zeros(len(edges), dtype=torch.float64).index_add_(
        0, bins.reshape(-1), torch.from_numpy(got.sample_counts).double().reshape(-1))
    assert observed.sum() == 256 * S
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert statistic < chi2.ppf(0.999, len(edges) - 1), (statistic, observed.tolist(), expected.tolist())


# --- the cache: manifest, reader, verify, stats ---


def test_sampled_cache_reads_back_with_counts(sampled_cache, capsys):
    manifest = load_manifest(sampled_cache)
    raw = json.loads((sampled_cache / "manifest.json").read_text())
    assert raw["version"] == 2
    assert raw["targets"] == {"k": 12, "value_codec": "fp32", "temperature": 0.02, "kind": "sampled", "samples": 12,
                              "proposal_temperature": 0.02, "seed": 0}
    assert CacheReader(sampled_cache).manifest.spec.targets.kind == "sampled" == manifest.spec.targets.kind
    for seq in _sequences(sampled_cache):
        assert seq.sample_counts.dtype == np.uint8 and seq.sample_counts.shape == seq.topk_ids.shape == (32, 12)
        assert (seq.sample_counts.sum(1) == 12).all() and seq.proposal_logprobs is None
        mass = np.exp(seq.topk_logprobs.astype(np.float64)) * (seq.sample_counts > 0)
        np.testing.assert_allclose(seq.tail_logmass, np.log1p(-mass.sum(1)), atol=1e-5)
    code, stdout, _ = run_cli(["verify", sampled_cache], capsys)
    assert code == 0 and " ok" in stdout
    code, stdout, _ = run_cli(["cache-stats", sampled_cache, "--json"], capsys)
    stats = json.loads(stdout)
    unique = stats["unique_ids_per_position"]
    histogram = unique["histogram"]
    assert histogram["unique_ids"] == list(range(1, 13)) and sum(histogram["counts"]) == 7 * 32
    assert 1 <= unique["mean"] <= 12 and unique["percentiles"]["p1"] <= unique["percentiles"]["p99"]
    means = [float((s.sample_counts > 0).sum(1).mean()) for s in _sequences(sampled_cache)]
    assert unique["mean"] == pytest.approx(np.mean(means))
    assert stats["bytes_per_token"] == pytest.approx(stats["bytes_on_disk"] / (7 * 32))
    assert stats["targets_kind"] == "sampled" and stats["sampling"]["samples"] == 12
    code, stdout, _ = run_cli(["cache-stats", sampled_cache], capsys)
    assert code == 0 and "unique ids per position" in stdout and "B/token" in stdout


def _broken_copy(cache: Path, tmp_path: Path, damage) -> Path:
    """A copy of ``cache`` whose shard 0 was rewritten, with ``damage`` applied to its decoded
    targets, by a writer that skips the row rules (so only verify's own checks can find it)."""
    from teacher_cache.writer import CacheWriter

    out = tmp_path / "broken"
    reader = CacheReader(cache)
    spec = reader.manifest.spec
    with CacheWriter(out, spec) as writer:
        for index, input_ids, offsets, targets in reader.iter_shards():
            targets = TeacherTargets(*(None if a is None else a.copy() for a in targets.arrays))
            if index == 0:
                damage(targets)
            seqs = [input_ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
            writer.write_shard(index, seqs, targets)
        writer.finalize()
    return out


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.sample_counts.__setitem__((3, 0), t.sample_counts[3, 0] + 1), "sum to 13, not samples=12"),
    (lambda t: t.topk_ids.__setitem__((5, 11), t.topk_ids[5, 10]), "row 5 holds an id twice"),
])
def test_verify_checks_sampled_rows(sampled_cache, tmp_path, capsys, damage, message):
    broken = _broken_copy(sampled_cache, tmp_path, damage)
    report = verify_cache(broken)
    assert not report.ok and report.first_bad == "00000.parquet" and message in report.message
    code, _, err = run_cli(["verify", broken], capsys)
    assert code != 0 and message in err


def test_old_topk_manifest_loads_reads_and_verifies(tmp_path):
    """tests/fixtures/topk_v1_cache was written by main before sampled targets (7e71169, by
    tests/test_cache_synth.py's write_cache of make_corpus(num_seqs=5, seq_len=12, k=4, seed=7))."""
    from test_cache_synth import make_corpus

    cache = tmp_path / "cache"
    shutil.copytree(FIXTURES / "topk_v1_cache", cache)
    raw = json.loads((cache / "manifest.json").read_text())
    manifest = load_manifest(cache)  # checks that its cache_id still matches its identity
    assert manifest.spec.targets.kind == "topk" and manifest.cache_id == raw["cache_id"] == "014cdef5e58065ab"
    assert manifest.to_dict() == raw  # written back as it was: version 1, no targets.kind
    assert verify_cache(cache).ok and verify_cache(cache, deep=True).ok
    corpus = make_corpus(num_seqs=5, seq_len=12, k=4, vocab=300, seed=7)
    reader = CacheReader(cache)
    for i, seq in enumerate(reader):
        want = corpus.targets[i]
        np.testing.assert_array_equal(seq.input_ids, corpus.sequences[i])
        np.testing.assert_array_equal(seq.topk_ids, want.topk_ids)
        np.testing.assert_array_equal(seq.topk_logprobs, want.topk_logprobs)
        assert seq.sample_counts is None and seq.proposal_logprobs is None
    batch = next(iter(CacheBatches(reader, range(5), batch_size=2)))
    assert batch.target_weights is None


def test_manifest_refuses_a_kind_its_version_does_not_allow():
    raw = json.loads((FIXTURES / "topk_v1_cache" / "manifest.json").read_text())
    from teacher_cache.errors import CacheError

    sampled = {**raw, "targets": {**raw["targets"], "k": 4, "kind": "sampled", "samples": 4,
                                  "proposal_temperature": 1.0, "seed": 0}}
    with pytest.raises(CacheError, match="does not match its sampled targets"):
        Manifest.from_dict({**sampled, "version": 1})
    with pytest.raises(CacheError, match="names its targets.kind"):
        Manifest.from_dict({**raw, "version": 2})
    with pytest.raises(CacheError, match="a top-k cache has no targets.seed"):
        Manifest.from_dict({**raw, "targets": {**raw["targets"], "seed": 0}})
    with pytest.raises(CacheError, match="version 4 is not supported"):
        Manifest.from_dict({**raw, "version": 4})


# --- determinism ---


def test_same_seed_same_cache_other_seed_other_draws(sampled_cache, tiny_teacher, tmp_path, capsys):
    again = _build(tiny_teacher, tmp_path / "again", capsys=capsys)
    assert _shards(again) == _shards(sampled_cache)
    other = _build(tiny_teacher, tmp_path / "other", "--seed", "1", capsys=capsys)
    assert _shards(other)[0] != _shards(sampled_cache)[0]
    a, b = _sequences(sampled_cache), _sequences(other)
    assert not all(np.array_equal(x.topk_ids, y.topk_ids) for x, y in zip(a, b))


def test_draws_do_not_depend_on_shards_batches_or_workers(sampled_cache, tiny_teacher, tmp_path, capsys):
    out = tmp_path / "array"
    for worker in (1, 0):
        _build(tiny_teacher, out, "--num-workers", "2", "--worker-index", str(worker), capsys=capsys)
    code, _, err = run_cli(["cache-merge", out], capsys)
    assert code == 0, err
    assert _shards(out) == _shards(sampled_cache)  # byte-identical shards
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", tmp_path / "resharded",
                            *[a for a in SMALL if a not in ("--shard-size", "2")], *SAMPLED, "--shard-size", "3",
                            "--batch-size", "2"], capsys)
    assert code == 0, err
    # Other batches round the teacher's logits differently in the last bits: the same draws, and
    # log-probs equal to float32 rounding.
    for x, y in zip(_sequences(sampled_cache), _sequences(tmp_path / "resharded")):
        for name in ("input_ids", "topk_ids", "sample_counts"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)
        for name in ("topk_logprobs", "tail_logmass", "target_logprob"):
            np.testing.assert_allclose(getattr(x, name), getattr(y, name), rtol=1e-5, atol=1e-5, err_msg=name)


# --- stage two: slot weights ---


def test_batch_weights_are_counts_over_samples(sampled_cache):
    reader = CacheReader(sampled_cache)
    data = CacheBatches(reader, range(7), batch_size=3, seq_len=20, seed=1)
    batch = next(iter(data))
    w = batch.target_weights
    assert w.dtype == torch.float32 and w.shape == batch.topk_ids.shape
    torch.testing.assert_close(w.sum(1), torch.ones(len(w)))  # every row is real here
    padded = batch.padded_to(24)
    real = padded.mask
    torch.testing.assert_close(padded.target_weights[real].sum(1), torch.ones(int(real.sum())))
    assert (padded.target_weights[~real] == 0).all()
    part = padded.positions(4, 9)
    torch.testing.assert_close(part.target_weights, padded.target_weights.view(3, 24, 12)[:, 4:9].reshape(-1, 12))
    assert padded.to("cpu").target_weights is not None
    # the slot with count c weighs c / S; padding slots weigh 0
    in_order = next(CacheBatches(reader, range(7), batch_size=2, shuffle=False).epoch_batches())
    counts = torch.from_numpy(reader.sequence(0).sample_counts.astype(np.float32))
    torch.testing.assert_close(in_order.target_weights[:32], counts / 12)


def test_batch_weights_are_importance_weights_with_another_proposal(tiny_teacher, tmp_path, capsys):
    cache = _build(tiny_teacher, tmp_path / "proposal", "--proposal-temperature", "0.03", capsys=capsys)
    spec = load_manifest(cache).spec
    assert spec.targets.proposal_temperature == 0.03 and not spec.targets.proposal_is_teacher
    reader = CacheReader(cache)
    seq = reader.sequence(2)
    assert seq.proposal_logprobs.dtype == np.float32 and seq.proposal_logprobs.shape == (32, 12)
    batch = CacheBatches(reader, [2], batch_size=1, shuffle=False).make_batch([(0, 2)])
    counts = seq.sample_counts.astype(np.float64)
    want = counts / 12 * np.exp(seq.topk_logprobs.astype(np.float64) - seq.proposal_logprobs) * (counts > 0)
    np.testing.assert_allclose(batch.target_weights.numpy(), want, rtol=1e-5)
    assert not np.allclose(batch.target_weights.sum(1).numpy(), 1.0)  # not counts / S
