"""The background batch prefetcher: the same batches as the plain stream, and a data position that
follows the batches handed out (not the ones built ahead), so checkpoints resume exactly."""

from __future__ import annotations

import pytest
import torch

from student.data import CacheBatches, Prefetcher
from teacher_cache.reader import CacheReader
from test_cache_synth import make_corpus, write_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefetch") / "cache"
    write_cache(path, make_corpus(num_seqs=20, seq_len=16, seed=2), shard_size=3)
    return path


def same(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "topk_ids", "topk_logprobs",
                                                                     "tail_logmass", "target_ids", "mask"))


def test_prefetcher_yields_the_plain_stream_and_tracks_the_consumed_position(cache):
    plain = CacheBatches(CacheReader(cache), range(20), batch_size=3, seq_len=8, seed=5)
    want = []
    for batch, _ in zip(plain, range(15)):  # 15 batches: past two epochs of 20 sequences
        want.append((batch, plain.state_dict()))
    with Prefetcher(CacheBatches(CacheReader(cache), range(20), batch_size=3, seq_len=8, seed=5), depth=3) as pre:
        for batch, state in want[:7]:
            assert same(next(pre), batch)
            assert pre.state_dict() == state  # although up to 3 more batches were built ahead
        resumed_at = pre.state_dict()
    fresh = CacheBatches(CacheReader(cache), range(20), batch_size=3, seq_len=8, seed=5)
    fresh.load_state_dict(resumed_at)
    with Prefetcher(fresh) as pre:
        for batch, state in want[7:]:
            assert same(next(pre), batch) and pre.state_dict() == state


def test_prefetcher_holds_at_most_most_held_batches_in_a_trainers_loop(cache):
    """The planner counts `Prefetcher.most_held` batches in host memory: a consumer that keeps each
    batch through a slow step (as the trainer's loop does, until the next one is handed over)
    finds no more alive at once, and a full queue reaches the count but for the last one (which
    exists only in the moment between the hand-over and the consumer letting go of its last)."""
    import time
    import weakref

    data = CacheBatches(CacheReader(cache), range(20), batch_size=3, seq_len=8, seed=5)
    built, build = [], data.make_batch

    def counted(picked):
        batch = build(picked)
        built.append(weakref.ref(batch))
        return batch

    data.make_batch = counted
    most = 0
    with Prefetcher(data) as pre:
        for _ in range(6):
            batch = next(pre)
            time.sleep(0.3)  # the step: the feeder and worker fill up meanwhile
            most = max(most, sum(ref() is not None for ref in built))
    del batch
    assert Prefetcher.most_held(data.prefetch_workers) - 1 <= most <= Prefetcher.most_held(data.prefetch_workers)


def test_prefetcher_raises_the_builders_error_in_the_consumer(cache):
    data = CacheBatches(CacheReader(cache), range(20), batch_size=3)

    def broken(picked):
        raise RuntimeError("shard went away")

    data.make_batch = broken
    with Prefetcher(data) as pre, pytest.raises(RuntimeError, match="shard went away"):
        next(pre)


def test_prefetcher_workers_run_their_cpu_ops_serially(cache):
    """A worker pins batches: with a count above 1 it would keep an OpenMP team of its own for the
    process's life (student/host_threads.py); each starts with a count of 1 instead."""
    if not torch.backends.openmp.is_available():
        pytest.skip("torch runs without OpenMP here: no teams to keep")
    data = CacheBatches(CacheReader(cache), range(20), batch_size=3, seq_len=8, seed=5)
    counts, build = [], data.make_batch

    def counted(picked):
        counts.append(torch.get_num_threads())  # on the worker's thread
        return build(picked)

    data.make_batch = counted
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # what the workers would take from the process without the setting
    try:
        with Prefetcher(data, workers=2) as pre:
            for _ in range(4):
                next(pre)
        assert torch.get_num_threads() == 2  # the main thread's is its own
    finally:
        torch.set_num_threads(threads)
    assert counts and set(counts) == {1}, counts
