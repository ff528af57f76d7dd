"""Batches from several caches (student/mixture.py): each cache's share of the sequences equals its
weight, one cache (or a cache beside a zero-weight one) reads exactly as today's stream, and the
position resumes exactly, also through the Prefetcher."""

from __future__ import annotations

import pytest
import torch

from distill.errors import DistillUserError
from student.data import Batch, CacheBatches, Prefetcher
from student.mixture import CacheSource, MixtureBatches, RunCaches, cat_batches, stream_seed
from teacher_cache.reader import CacheReader
from test_cache_synth import make_corpus, write_cache


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    paths = []
    for i, (num_seqs, seq_len) in enumerate([(20, 16), (13, 24), (7, 12)]):
        write_cache(root / f"c{i}", make_corpus(num_seqs=num_seqs, seq_len=seq_len, seed=10 + i), shard_size=4)
        paths.append(root / f"c{i}")
    return paths


def mixture(paths, weights, batch_size=5, seed=3, **kwargs) -> MixtureBatches:
    streams = []
    for place, path in enumerate(paths):
        reader = CacheReader(path)
        streams.append(CacheBatches(reader, range(reader.num_sequences), 1, seed=stream_seed(seed, place), **kwargs))
    return MixtureBatches(streams, weights, batch_size)


def equal(a: Batch, b: Batch) -> bool:
    """Every field equal, NaN where NaN (target_logprob's last rows)."""
    same = lambda x, y: x.shape == y.shape and bool(((x == y) | (x.isnan() & y.isnan()) if x.is_floating_point()
                                                     else x == y).all())
    return all((x is None and y is None) or (x is not None and y is not None and same(x, y))
               for x, y in zip(vars(a).values(), vars(b).values()))


def test_each_caches_share_of_the_sequences_is_its_weight(caches):
    data = mixture(caches, [0.5, 0.3, 0.2], batch_size=7)
    picks = data.picks()
    for steps in (1, 3, 10, 40):
        while sum(data.taken) < 7 * steps:
            next(picks)
        n = sum(data.taken)
        for weight, taken in zip([0.5, 0.3, 0.2], data.taken):
            assert abs(taken - weight * n) < 1  # within one sequence, at every point
    counts = [0, 0, 0]
    for picked in (next(picks) for _ in range(20)):
        for cache, _, index in picked:
            counts[cache] += 1
            assert index < [20, 13, 7][cache]
    assert counts == [70, 42, 28]  # 140 sequences in the shares 0.5, 0.3, 0.2


def test_weights_that_do_not_sum_to_one_are_shares(caches):
    a, b = mixture(caches[:2], [7, 3]), mixture(caches[:2], [0.7, 0.3])
    assert a.weights == pytest.approx(b.weights)
    assert [next(a.picks()) for _ in range(1)] == [next(b.picks()) for _ in range(1)]


def test_one_cache_or_a_zero_weight_partner_reads_as_the_cache_alone(caches):
    plain = CacheBatches(CacheReader(caches[0]), range(20), 5, seed=3, seq_len=10)
    alone = mixture(caches[:1], [1.0], seq_len=10)
    with_zero = mixture([caches[0], caches[0]], [1.0, 0.0], seq_len=10)
    for want, a, b, _ in zip(plain, alone, with_zero, range(9)):  # past the first epoch
        assert equal(want, a) and equal(want, b)
    assert plain.state_dict() == alone.streams[0].state_dict() == with_zero.streams[0].state_dict()


def test_the_position_resumes_exactly_also_through_the_prefetcher(caches):
    reference = mixture(caches, [0.6, 0.3, 0.1])
    want = [(batch, reference.state_dict()) for batch, _ in zip(reference, range(14))]
    with Prefetcher(mixture(caches, [0.6, 0.3, 0.1]), depth=3) as stream:
        for batch, state in want[:6]:
            assert equal(next(stream), batch) and stream.state_dict() == state
        saved = stream.state_dict()
    fresh = mixture(caches, [0.6, 0.3, 0.1])
    fresh.load_state_dict(saved)
    for (batch, state), got in zip(want[6:], fresh):
        assert equal(got, batch) and fresh.state_dict() == state
    with pytest.raises(DistillUserError, match="fresh run directory"):
        mixture(caches, [0.5, 0.3, 0.2]).load_state_dict(saved)


def test_ranks_split_each_batch_into_contiguous_shares(caches):
    whole = next(mixture(caches, [0.5, 0.3, 0.2], batch_size=6).picks())
    shares = []
    for rank in range(2):
        streams = mixture(caches, [0.5, 0.3, 0.2]).streams
        shares += next(MixtureBatches(streams, [0.5, 0.3, 0.2], 6, part=(rank, 2)).picks())
    assert shares == whole


def test_a_batch_joins_the_caches_sequences_padded_to_the_longest(caches):
    data = mixture(caches, [0.4, 0.4, 0.2], batch_size=5)
    picked = next(data.picks())
    batch = data.make_batch(picked)
    parts = [data.streams[i].make_batch([(e, j) for c, e, j in picked if c == i]) for i in range(3)]
    length = max(p.input_ids.shape[1] for p in parts)
    assert batch.input_ids.shape == (5, length)
    assert equal(batch, cat_batches([p.padded_to(length) for p in parts]))
    assert batch.num_tokens == sum(p.num_tokens for p in parts)


@pytest.mark.parametrize("weights, match", [([1.0], "1 weight"), ([0.5, -0.5], ">= 0"), ([0.0, 0.0], "positive")])
def test_weights_that_cannot_be_shares_are_refused_in_one_line(caches, weights, match):
    with pytest.raises(DistillUserError, match=match) as error:
        mixture(caches[:2], weights)
    assert "--cache-weights" in str(error.value) and "\n" not in str(error.value)


def test_a_mixture_of_a_cache_with_itself_reads_the_cache_every_sequence_equally_often(caches):
    """Two streams over one cache at 0.5 / 0.5: after two epochs' worth of sequences each stream has
    made one pass, so every sequence was read exactly twice, as the cache alone reads it over two
    epochs; and the batches are the cache's own sequences and rows."""
    from collections import Counter

    data = mixture([caches[0], caches[0]], [0.5, 0.5], batch_size=4)
    counts = Counter()
    picks = data.picks()
    while sum(data.taken) < 40:  # two epochs of the cache's 20 sequences
        counts.update(index for _, _, index in next(picks))
    assert counts == Counter({i: 2 for i in range(20)})
    plain = CacheBatches(CacheReader(caches[0]), range(20), 1)
    batch = next(iter(mixture([caches[0], caches[0]], [0.5, 0.5], batch_size=1)))
    first = next(iter(mixture([caches[0]], [1.0], batch_size=1)))
    assert equal(batch, first) and equal(first, plain.make_batch([(0, data.streams[0].epoch_order(0)[0])]))


@pytest.mark.parametrize("count", [1, 3])
def test_the_run_streams_keep_as_many_decoded_shards_as_loader_shards(caches, count):
    """RunCaches.stream hands --loader-shards to every cache's stream: after batches from many shards,
    each stream's shard cache holds that many decoded shards (4 shards a cache here)."""
    sources = [CacheSource(r, None, list(range(r.num_sequences)), []) for r in map(CacheReader, caches[:count])]
    held = {}
    for keep in (1, 3):
        data = RunCaches(sources, [1.0] * count, None).stream(4, seq_len=None, seed=0, pin_memory=False, part=(0, 1),
                                                              lru_shards=keep)
        for _, _ in zip(data, range(6)):
            pass
        held[keep] = [len(s._thread_lru().shards) for s in (data.streams if count > 1 else [data])]
    assert held[1] == [1] * count
    assert all(n > 1 for n in held[3])
