"""Synthetic teacher data for the cache tests, built from full distributions so every answer is known.

Each position gets random logits over a small vocabulary; its next token is sampled from that
distribution, so top-k, tail mass, target log-prob, entropy and the actual token's rank are all
exact functions of arrays the test holds. The other test_cache_* files import from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from teacher_cache.targets import TeacherTargets


@dataclass
class SynthCorpus:
    sequences: list[np.ndarray]  # int32 [L_i] each
    targets: list[TeacherTargets]  # L_i rows each
    full_logprobs: np.ndarray  # float64 [sum L_i, vocab], the whole distributions

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def shard(self, index: int, shard_size: int) -> tuple[list[np.ndarray], TeacherTargets]:
        lo, hi = index * shard_size, min((index + 1) * shard_size, len(self.sequences))
        return self.sequences[lo:hi], TeacherTargets.concat(self.targets[lo:hi])


def make_corpus(num_seqs: int = 10, seq_len: int = 24, k: int = 8, vocab: int = 300, seed: int = 0,
                ragged: bool = True) -> SynthCorpus:
    """Sequences of length seq_len (or random lengths in [2, seq_len] when ragged)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, seq_len + 1, num_seqs) if ragged else np.full(num_seqs, seq_len)
    n = int(lengths.sum())
    # a peaked distribution with a long tail, like a language model's
    logits = rng.standard_normal((n, vocab)) * 2.0 + 6.0 * (rng.random((n, vocab)) < 0.01)
    logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    sampled = np.argmax(logprobs + rng.gumbel(size=logprobs.shape), axis=1)
    order = np.argsort(-logprobs, axis=1, kind="stable")[:, :k]
    topk_lp = np.take_along_axis(logprobs, order, axis=1)
    tail = np.log1p(-np.exp(topk_lp).sum(axis=1))
    sequences, targets, start = [], [], 0
    for length in lengths:
        rows = slice(start, start + length)
        ids = np.empty(length, dtype=np.int32)
        ids[0] = rng.integers(vocab)
        ids[1:] = sampled[start:start + length - 1]  # token t+1 was drawn from row t
        target = np.full(length, np.nan)
        target[:-1] = logprobs[np.arange(start, start + length - 1), ids[1:]]
        sequences.append(ids)
        targets.append(TeacherTargets(order[rows].astype(np.int32), topk_lp[rows].astype(np.float32),
                                      tail[rows].astype(np.float32), target.astype(np.float32)))
        start += length
    return SynthCorpus(sequences, targets, logprobs)


def make_spec(corpus: SynthCorpus, *, k: int = 8, vocab: int = 300, codec: str = "fp32", fmt: str = "zarr",
              shard_size: int = 4, seq_len: int = 24, **overrides) -> dict:
    """A writer spec in the nested-dict form ``teacher_cache.build`` passes; overrides as section__key=value."""
    spec = {
        "teacher": {"path": "synthetic", "weights_hash": "w0", "backend": "hf", "dtype": "float32"},
        "tokenizer": {"hash": "t0", "vocab_size": vocab, "special_ids": {"bos": 1, "eos": 2, "pad": None}},
        "data": {"source": "synthetic", "fingerprint": "f0", "sequences": len(corpus.sequences),
                 "tokens": corpus.num_tokens, "seq_len": seq_len},
        "targets": {"k": k, "value_codec": codec, "temperature": 1.0},
        "storage": {"format": fmt, "shard_size": shard_size},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        spec[section][key] = value
    return spec


def write_cache(path, corpus: SynthCorpus, **spec_kwargs):
    from teacher_cache.writer import CacheWriter

    with CacheWriter(path, make_spec(corpus, **spec_kwargs)) as writer:
        shard_size = writer.spec.storage.shard_size
        for i in range(writer.num_shards):
            writer.write_shard(i, *corpus.shard(i, shard_size))
        return writer.finalize()


def test_synthetic_targets_follow_the_cache_convention():
    corpus = make_corpus(num_seqs=3, k=5)
    for ids, t in zip(corpus.sequences, corpus.targets):
        assert np.all(np.diff(t.topk_logprobs, axis=1) <= 0)  # descending probability
        assert np.isnan(t.target_logprob[-1]) and np.all(np.isfinite(t.target_logprob[:-1]))
        mass = np.exp(t.topk_logprobs.astype(np.float64)).sum(axis=1)
        np.testing.assert_allclose(np.exp(t.tail_logmass), 1 - mass, rtol=1e-4)
        assert t.topk_ids.dtype == np.int32 and len(ids) == t.num_positions
