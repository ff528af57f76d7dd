"""Stage one through `build_cache` with the real default teacher: an interrupted build, re-run
with the same arguments, resumes and ends with the same cache as an uninterrupted one."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from teacher_cache.backends import make_backend
from teacher_cache.build import CacheConfig, build_cache
from teacher_cache.identity import tokenizer_info
from teacher_cache.reader import CacheReader


class InterruptAfter:
    """Wraps the real backend and raises KeyboardInterrupt on its n-th score call (a test double
    for the user's Ctrl-C only; the scoring itself is the real teacher's)."""

    def __init__(self, backend, calls: int):
        self.backend, self.calls = backend, calls
        self.name, self.vocab_size = backend.name, backend.vocab_size

    def score(self, sequences, k):
        self.calls -= 1
        if self.calls < 0:
            raise KeyboardInterrupt
        return self.backend.score(sequences, k)

    def describe(self):
        return self.backend.describe()


@pytest.fixture(scope="module")
def setup(teacher_dir, teacher_tokenizer):
    from pipelines.corpus import CorpusConfig, prepare_corpus

    corpus = prepare_corpus(CorpusConfig(seq_len=40, max_sequences=7), teacher_tokenizer, progress=False)
    backend = make_backend("hf", teacher_dir, dtype="float32", device="cpu", batch_size=2)
    kwargs = dict(
        tokenizer=tokenizer_info(teacher_tokenizer),
        data={"source": corpus.source, "fingerprint": corpus.fingerprint, "seq_len": corpus.seq_len},
        progress=False,
    )
    yield corpus, backend, kwargs
    backend.close()


@pytest.mark.parametrize("storage", ["parquet", "zarr"])
def test_interrupted_build_resumes_to_identical_cache(setup, tmp_path, storage, caplog):
    corpus, backend, kwargs = setup
    config = dict(k=16, shard_size=2, batch_size=2, storage=storage)
    clean = build_cache(corpus.sequences, backend, CacheConfig(out=tmp_path / "clean", **config), **kwargs)
    assert clean.written_shards == 4

    resumed_dir = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        build_cache(corpus.sequences, InterruptAfter(backend, calls=3), CacheConfig(out=resumed_dir, **config), **kwargs)
    assert json.loads((resumed_dir / "manifest.json").read_text())["status"] == "incomplete"
    with caplog.at_level(logging.INFO, logger="teacher_cache.build"):
        report = build_cache(corpus.sequences, backend, CacheConfig(out=resumed_dir, **config), **kwargs)
    assert report.resumed_shards >= 1 and report.resumed_shards + report.written_shards == 4
    assert "resuming" in caplog.text

    shards = lambda d: [(s["name"], s["checksum"]) for s in json.loads((d / "manifest.json").read_text())["shards"]]
    assert shards(resumed_dir) == shards(tmp_path / "clean")
    a, b = CacheReader(tmp_path / "clean"), CacheReader(resumed_dir)
    assert a.manifest.cache_id == b.manifest.cache_id
    for i in range(len(a)):
        np.testing.assert_array_equal(a.sequence(i).topk_logprobs, b.sequence(i).topk_logprobs)


def test_cache_matches_backend_output(setup, tmp_path):
    """What the reader returns is what the teacher produced (fp32 codec: exact)."""
    corpus, backend, kwargs = setup
    build_cache(corpus.sequences, backend, CacheConfig(out=tmp_path / "c", k=8, value_codec="fp32"), **kwargs)
    reader = CacheReader(tmp_path / "c")
    direct = backend.score(corpus.sequences[:2], 8)
    for i in range(2):
        seq = reader.sequence(i)
        np.testing.assert_array_equal(seq.input_ids, corpus.sequences[i])
        np.testing.assert_array_equal(seq.topk_ids, direct[i].topk_ids)
        np.testing.assert_allclose(seq.topk_logprobs, direct[i].topk_logprobs, atol=1e-5)
        np.testing.assert_allclose(seq.target_logprob, direct[i].target_logprob, atol=1e-5)
        assert np.isnan(seq.target_logprob[-1]) and np.isfinite(seq.target_logprob[:-1]).all()
