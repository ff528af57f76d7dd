"""Hybrid teacher targets (issue 20, ``--targets topk+sampled``): the exact top-K, then S draws from
the teacher outside it. The rows against a dense reference of the teacher's full distribution, the
slot weights' unbiasedness, codecs, determinism across shards / batches / workers, the manifest
(version 3; versions 1 and 2 unchanged), verify, cache-stats, and stage two (the loss against the
dense reference, train-student)."""

from __future__ import annotations

import json
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
from test_sampled_cache import SMALL, _broken_copy, _rows, _sequences, _shards

K, S = 4, 12
HYBRID = ["--targets", "topk+sampled", "-k", str(K), "--samples", str(S), "--codec", "fp32"]


def _build(tiny_teacher, out, *extra, capsys=None):
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL, *HYBRID, *extra], capsys)
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def hybrid_cache(tmp_path_factory, tiny_teacher):
    out = tmp_path_factory.mktemp("hybrid") / "cache"
    run_cli_ok(["cache-teacher", "--model", tiny_teacher, "--out", out, *SMALL, *HYBRID])
    return out


def _check_rows(ids, lp, tail, counts, prop, full, proposal_full, head):
    """A hybrid row block against the dense teacher ``full`` [N, V] (log-probs at T) and the dense
    proposal ``proposal_full`` (None: the teacher)."""
    ids, lp, tail, counts, prop = (None if a is None else torch.as_tensor(np.array(a))
                                   for a in (ids, lp, tail, counts, prop))
    ids, counts = ids.long(), counts.long()
    n, slots = ids.shape
    samples = slots - head
    top_lp, top_ids = full.topk(head, dim=-1)
    assert torch.equal(ids[:, :head], top_ids)  # the exact head is the teacher's top-K, in order
    torch.testing.assert_close(lp[:, :head].double(), top_lp.double(), atol=2e-4, rtol=0)
    assert (counts[:, :head] == 0).all() and (counts.sum(1) == samples).all()
    assert all(len(set(row.tolist())) == slots for row in ids)  # distinct: no drawn or padding id is in the head
    drawn = counts[:, head:] > 0
    assert (drawn[:, :-1] >= drawn[:, 1:]).all()
    key = (samples - counts[:, head:]) * full.shape[1] + ids[:, head:]
    assert (key[:, :-1] < key[:, 1:]).all()  # count descending, then id ascending; padding likewise
    torch.testing.assert_close(lp.double(), full.gather(1, ids).double(), atol=2e-4, rtol=0)
    outside = full.double().scatter(1, top_ids, float("-inf")).logsumexp(-1)  # log(1 - P_K), without cancelling
    torch.testing.assert_close(tail.double(), outside, atol=1e-4, rtol=1e-4)
    if proposal_full is None:
        assert prop is None
    else:
        restricted = proposal_full.scatter(1, top_ids, float("-inf")).log_softmax(-1)
        prop = prop.double()
        assert torch.isneginf(prop[:, :head]).all()
        torch.testing.assert_close(prop[:, head:], restricted.gather(1, ids[:, head:]).double(), atol=2e-4, rtol=0)


# --- the draws (kernels/sample_targets.py, head=K) ---


@pytest.mark.parametrize("proposal", [None, 0.7])
@pytest.mark.parametrize("head", [1, 5])
def test_hybrid_rows_against_the_dense_teacher(proposal, head):
    hidden, weight = _rows()
    T, V = 1.3, 97
    uniforms = torch.from_numpy(np.random.default_rng(0).random((64, S)))
    next_ids = torch.randint(0, V, (64,))
    out = sample_targets(hidden, weight, uniforms, next_ids, temperature=T, proposal_temperature=proposal, head=head)
    logits = hidden @ weight.T
    full = torch.log_softmax(logits / T, -1)
    _check_rows(out[0], out[1], out[2], out[4], out[5], full,
                None if proposal is None else torch.log_softmax(logits / proposal, -1), head)
    ids, counts = out[0].long(), out[4].long()
    for row in range(64):  # padding: the smallest ids neither drawn nor in the head
        taken = set(ids[row][:head].tolist()) | set(ids[row][head:][counts[row][head:] > 0].tolist())
        pad = ids[row][head:][counts[row][head:] == 0].tolist()
        assert pad == [v for v in range(V) if v not in taken][:len(pad)]
    torch.testing.assert_close(out[3], full[torch.arange(64), next_ids])
    again = sample_targets(hidden, weight, uniforms, next_ids, temperature=T, proposal_temperature=proposal,
                           head=head, chunk_size=5)
    assert torch.equal(again[0], out[0]) and torch.equal(again[4], out[4])
    # without a head the draws are the sampled kind's, unchanged
    plain = sample_targets(hidden, weight, uniforms, next_ids, temperature=T, proposal_temperature=proposal)
    assert plain[0].shape == (64, S) and (plain[4].sum(1) == S).all()


def test_head_out_of_range_is_refused():
    hidden, weight = _rows(v=20)
    uniforms = torch.from_numpy(np.random.default_rng(0).random((64, 12)))
    with pytest.raises(ValueError, match=r"head \(exact top ids per row\) must be an int in \[0, vocab_size - S = 8\]"):
        sample_targets(hidden, weight, uniforms, head=9)


@pytest.mark.parametrize("proposal", [None, 0.6, 2.5])
def test_hybrid_slot_weights_are_unbiased_for_the_teacher(proposal):
    """E[sum of weights at id v] = p(v) at every v: exactly p on the top-K, in expectation outside."""
    head, samples, V = 3, 8, 40
    hidden, weight = _rows(seed=1, n=1, d=8, v=V, scale=1.0)
    N, T = 4000, 0.8
    uniforms = torch.from_numpy(np.random.default_rng(1).random((N, samples)))
    out = sample_targets(hidden.expand(N, -1).contiguous(), weight, uniforms, temperature=T,
                         proposal_temperature=proposal, head=head)
    targets = TeacherTargets(*(None if t is None else t.numpy() for t in out))
    w = target_weights(targets, head).astype(np.float64)
    per_id = np.zeros((N, V))
    np.add.at(per_id, (np.repeat(np.arange(N), head + samples), targets.topk_ids.reshape(-1)), w.reshape(-1))
    logits = (hidden @ weight.T)[0].double()
    p = torch.softmax(logits / T, -1).numpy()
    top = np.argsort(-p)[:head]
    outside = np.ones(V, bool)
    outside[top] = False
    q = torch.softmax(logits / (proposal or T), -1).numpy()
    r = np.where(outside, q, 0.0) / q[outside].sum()  # the proposal restricted to the ids outside the top-K
    # The top-K weigh p exactly on every row; outside, the weight at v is (c_v / S) p(v) / r(v)
    # with c_v ~ Binomial(S, r(v)).
    np.testing.assert_allclose(per_id[:, top], np.broadcast_to(p[top], (N, head)), rtol=1e-5)
    stderr = p[outside] / r[outside] * np.sqrt(r[outside] * (1 - r[outside]) / (samples * N))
    assert (np.abs(per_id.mean(0)[outside] - p[outside]) <= 5 * stderr + 1e-6).all()
    np.testing.assert_allclose(w[:, :head].sum(1), p[top].sum(), rtol=1e-5)  # the exact part sums to P_K
    if proposal is None:  # and the drawn part to 1 - P_K, exactly
        np.testing.assert_allclose(w[:, head:].sum(1), 1 - p[top].sum(), rtol=1e-5)


@pytest.mark.parametrize("codec", ["fp32", "sqrt8", "bf16"])
def test_any_codec_keeps_the_head_and_the_drawn_slots_apart(codec):
    from teacher_cache.codecs import get_codec
    from teacher_cache.store import decode_shard, encode_shard

    hidden, weight = _rows(seed=2, n=40, v=61)
    out = sample_targets(hidden, weight, torch.from_numpy(np.random.default_rng(2).random((40, 9))),
                         temperature=1.0, proposal_temperature=1.7, head=5)
    targets = TeacherTargets(*(None if t is None else t.numpy() for t in out))
    arrays = encode_shard([np.zeros(25, np.int32), np.zeros(15, np.int32)], targets, get_codec(codec), head=5)
    assert arrays["sample_counts"].shape == (40, 9) and arrays["proposal_logprobs"].shape == (40, 9)
    assert any(name.startswith("drawn_") for name in arrays)
    _, _, back = decode_shard(arrays, get_codec(codec), "x")
    # a quantising codec's rank order of the top-K may swap ids whose probabilities round alike
    by_id = np.argsort(back.topk_ids[:, :5], 1)
    np.testing.assert_array_equal(np.take_along_axis(back.topk_ids[:, :5], by_id, 1), np.sort(targets.topk_ids[:, :5]))
    if codec == "fp32":
        np.testing.assert_array_equal(back.topk_ids[:, :5], targets.topk_ids[:, :5])
    for name in ("topk_ids", "sample_counts", "proposal_logprobs"):
        np.testing.assert_array_equal(getattr(back, name)[:, 5:], getattr(targets, name)[:, 5:], err_msg=name)
    np.testing.assert_array_equal(back.tail_logmass, targets.tail_logmass)
    np.testing.assert_array_equal(back.sample_counts[:, :5], 0)
    assert np.isneginf(back.proposal_logprobs[:, :5]).all()
    np.testing.assert_allclose(np.exp(back.topk_logprobs[:, 5:]), np.exp(targets.topk_logprobs[:, 5:]), atol=4e-3)


# --- the cache ---


def _dense_teacher(tiny_teacher, reader: CacheReader, temperature: float) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_teacher, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.from_numpy(reader.sequence(i).input_ids.astype(np.int64))[None])
                                  .logits[0].double() / temperature, -1) for i in range(len(reader))]


def test_hybrid_cache_rows_against_the_dense_teacher(hybrid_cache, tiny_teacher, capsys):
    raw = json.loads((hybrid_cache / "manifest.json").read_text())
    assert raw["version"] == 3
    assert raw["targets"] == {"k": K + S, "value_codec": "fp32", "temperature": 0.02, "kind": "topk+sampled",
                              "samples": S, "proposal_temperature": 0.02, "seed": 0, "topk": K}
    reader = CacheReader(hybrid_cache)
    targets = reader.manifest.spec.targets
    assert targets.kind == "topk+sampled" and targets.head == K and targets.sampled and targets.hybrid
    for i, full in enumerate(_dense_teacher(tiny_teacher, reader, 0.02)):
        seq = reader.sequence(i)
        assert seq.sample_counts.dtype == np.uint8 and seq.topk_ids.shape == (32, K + S)
        _check_rows(seq.topk_ids, seq.topk_logprobs, seq.tail_logmass, seq.sample_counts, seq.proposal_logprobs,
                    full, None, K)
    code, stdout, _ = run_cli(["verify", hybrid_cache], capsys)
    assert code == 0 and " ok" in stdout


def test_hybrid_cache_stats(hybrid_cache, capsys):
    code, stdout, _ = run_cli(["cache-stats", hybrid_cache, "--json"], capsys)
    assert code == 0
    stats = json.loads(stdout)
    assert stats["targets_kind"] == "topk+sampled" and stats["sampling"]["topk"] == K
    unique = stats["unique_ids_per_position"]
    assert unique["histogram"]["unique_ids"] == list(range(1, S + 1)) and sum(unique["histogram"]["counts"]) == 7 * 32
    means = [float((s.sample_counts > 0).sum(1).mean()) for s in _sequences(hybrid_cache)]
    assert unique["mean"] == pytest.approx(np.mean(means))  # the drawn ids outside the top-K only
    assert stats["bytes_per_token"] == pytest.approx(stats["bytes_on_disk"] / (7 * 32))
    assert stats["fp32_bytes_per_token"] == 8 * (K + S) + 8 + S  # a count per drawn slot only
    code, stdout, _ = run_cli(["cache-stats", hybrid_cache], capsys)
    assert code == 0 and "unique tail ids per position" in stdout and f"outside the exact top-{K}" in stdout


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.sample_counts.__setitem__((3, K), t.sample_counts[3, K] + 1), f"sum to {S + 1}, not samples={S}"),
    (lambda t: t.topk_ids.__setitem__((5, K), t.topk_ids[5, 0]), "row 5 holds an id twice"),
])
def test_verify_checks_hybrid_rows(hybrid_cache, tmp_path, capsys, damage, message):
    broken = _broken_copy(hybrid_cache, tmp_path, damage)
    report = verify_cache(broken)
    assert not report.ok and report.first_bad == "00000.parquet" and message in report.message
    code, _, err = run_cli(["verify", broken], capsys)
    assert code != 0 and message in err


def test_manifest_versions(hybrid_cache):
    from teacher_cache.errors import CacheError

    raw = json.loads((hybrid_cache / "manifest.json").read_text())
    assert load_manifest(hybrid_cache).to_dict() == raw
    with pytest.raises(CacheError, match="does not match its topk\\+sampled targets"):
        Manifest.from_dict({**raw, "version": 2})
    sampled = {**raw, "version": 2, "targets": {**{key: v for key, v in raw["targets"].items() if key != "topk"},
                                                "kind": "sampled"}}
    with pytest.raises(CacheError, match="targets.k must equal targets.samples in a sampled cache"):
        Manifest.from_dict(sampled)
    with pytest.raises(CacheError, match="a sampled cache has no targets.topk"):
        Manifest.from_dict({**raw, "version": 2, "targets": {**raw["targets"], "kind": "sampled"}})
    with pytest.raises(CacheError, match="targets.topk must be an integer >= 1, got None"):
        Manifest.from_dict({**raw, "targets": {key: v for key, v in raw["targets"].items() if key != "topk"}})
    with pytest.raises(CacheError, match="targets.k must equal targets.topk \\+ targets.samples"):
        Manifest.from_dict({**raw, "targets": {**raw["targets"], "k": K + S + 1}})
    with pytest.raises(CacheError, match="a top-k cache has no targets.samples, targets.proposal_temperature, "
                                         "targets.seed, targets.topk"):
        Manifest.from_dict({**raw, "version": 1, "targets": {**raw["targets"], "kind": "topk"}})


def test_same_draws_across_shards_batches_and_workers(hybrid_cache, tiny_teacher, tmp_path, capsys):
    assert _shards(_build(tiny_teacher, tmp_path / "again", capsys=capsys)) == _shards(hybrid_cache)
    other = _build(tiny_teacher, tmp_path / "other", "--seed", "1", capsys=capsys)
    assert not all(np.array_equal(x.topk_ids, y.topk_ids) for x, y in zip(_sequences(hybrid_cache),
                                                                           _sequences(other)))
    out = tmp_path / "array"
    for worker in (1, 0):
        _build(tiny_teacher, out, "--num-workers", "2", "--worker-index", str(worker), capsys=capsys)
    code, _, err = run_cli(["cache-merge", out], capsys)
    assert code == 0, err
    assert _shards(out) == _shards(hybrid_cache)  # byte-identical shards
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--out", tmp_path / "resharded",
                            *[a for a in SMALL if a not in ("--shard-size", "2")], *HYBRID, "--shard-size", "3",
                            "--batch-size", "2"], capsys)
    assert code == 0, err
    for x, y in zip(_sequences(hybrid_cache), _sequences(tmp_path / "resharded")):
        for name in ("input_ids", "topk_ids", "sample_counts"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)
        for name in ("topk_logprobs", "tail_logmass", "target_logprob"):
            np.testing.assert_allclose(getattr(x, name), getattr(y, name), rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_long_sequence_prefilled_in_chunks_draws_as_one_forward(tiny_teacher):
    from teacher_cache.backends.hf import HFBackend

    seq = np.random.default_rng(0).integers(0, 49152, 40)
    sampling = Sampling(samples=6, proposal_temperature=0.03, seed=5, topk=3)
    whole, chunked = (HFBackend(tiny_teacher, dtype="float32", device="cpu", temperature=0.02, prefill_tokens=p)
                      .score([seq], 9, sampling=sampling, indices=[3])[0] for p in (64, 16))
    np.testing.assert_array_equal(chunked.topk_ids, whole.topk_ids)
    np.testing.assert_array_equal(chunked.sample_counts, whole.sample_counts)
    np.testing.assert_allclose(chunked.proposal_logprobs, whole.proposal_logprobs, atol=1e-4)


# --- stage two ---


def test_batch_weights_and_loss_against_the_dense_reference(hybrid_cache, tiny_teacher):
    from student.loss import LossConfig, distill_loss

    reader = CacheReader(hybrid_cache)
    T = reader.manifest.spec.targets.temperature
    batch = CacheBatches(reader, [1, 4], batch_size=2, shuffle=False).make_batch([(0, 1), (0, 4)]).padded_to(36)
    real = batch.mask
    w = batch.target_weights
    dense = _dense_teacher(tiny_teacher, reader, T)
    p = torch.cat([dense[1], dense[4]]).exp()  # [64, V], the rows of the two real sequences
    # the top-K weigh p exactly; the drawn slots (c / S)(1 - P_K); a row sums to 1; padding 0
    batch_counts = torch.cat([torch.from_numpy(np.array(reader.sequence(i).sample_counts)) for i in (1, 4)]).double()
    p_head = p.gather(1, batch.topk_ids[real][:, :K])
    torch.testing.assert_close(w[real][:, :K].double(), p_head, rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(w[real][:, K:].double(), batch_counts[:, K:] / S * (1 - p_head.sum(1, keepdim=True)),
                               rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(w[real].sum(1).double(), torch.ones(int(real.sum()), dtype=torch.float64), rtol=1e-5,
                               atol=1e-5)
    assert (w[~real] == 0).all() and batch_counts.shape == (64, K + S)

    vocab, d = reader.manifest.spec.tokenizer.vocab_size, 8
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(len(real), d, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, d, generator=gen, requires_grad=True)
    loss, kl = distill_loss(hidden, weight, batch, LossConfig(), cache_temperature=T)
    loss.backward()
    got = hidden.grad.clone(), weight.grad.clone()
    # Dense reference: sum_j w_j (l_j - log q(u_j)) over the real rows, from the teacher's full
    # distribution at the slots' ids and the weights above, KL scaled by T^2 as every tail is.
    hidden.grad = weight.grad = None
    logq = torch.log_softmax(hidden @ weight.T / T, dim=-1)[real]
    ids = batch.topk_ids[real]
    logp = torch.log(p.gather(1, ids)).float()
    per_row = (w[real] * (logp - logq.gather(1, ids))).sum(1)
    expected = T**2 * per_row.mean()
    expected.backward()
    torch.testing.assert_close(kl, per_row.mean().detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-3, atol=1e-7)


def test_batch_weights_with_another_proposal(tiny_teacher, tmp_path, capsys):
    cache = _build(tiny_teacher, tmp_path / "proposal", "--proposal-temperature", "0.03", capsys=capsys)
    reader = CacheReader(cache)
    seq = reader.sequence(2)
    assert seq.proposal_logprobs.shape == (32, K + S) and np.isneginf(seq.proposal_logprobs[:, :K]).all()
    batch = CacheBatches(reader, [2], batch_size=1, shuffle=False).make_batch([(0, 2)])
    lp, counts = seq.topk_logprobs.astype(np.float64), seq.sample_counts.astype(np.float64)
    want = counts / S * np.exp(np.where(counts > 0, lp - seq.proposal_logprobs, 0.0)) * (counts > 0)
    want[:, :K] = np.exp(lp[:, :K])
    np.testing.assert_allclose(batch.target_weights.numpy(), want, rtol=1e-5)


def test_train_student_on_a_hybrid_cache(hybrid_cache, tiny_teacher, tmp_path, capsys):
    from cli_helpers import one_error_line
    from test_sampled_training import _other_student

    run, student = tmp_path / "run", _other_student(tiny_teacher, tmp_path / "student")
    args = ["train-student", "--cache", hybrid_cache, "--out", run, "--student", student, "--steps", "4",
            "--batch-size", "2", "--heldout", "1", "--lr", "1e-2", "--log-every", "1", "--quiet"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 4 and all(np.isfinite(r["kl"]) for r in train)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and evals[-1]["kl"] < evals[0]["kl"]
    code, _, err = run_cli([*args[:4], tmp_path / "other", *args[5:], "--temperature", "1"], capsys)
    line = one_error_line(code, err)
    assert "--temperature" in line and "topk+sampled" in line, line
