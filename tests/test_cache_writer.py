"""Writer (claim, lock, resume, mismatch, finalize), reader (checks, access, corruption) and verify."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from teacher_cache.codecs import codec_names
from teacher_cache.errors import CacheError, CacheLockedError, CacheMismatchError, CorruptShardError
from teacher_cache.reader import CacheReader
from teacher_cache.verify import check_shards, verify_cache
from teacher_cache.writer import CacheLock, CacheWriter
from test_cache_synth import make_corpus, make_spec, write_cache

FORMATS = ("zarr", "parquet")


@pytest.fixture(scope="module")
def corpus():
    return make_corpus(num_seqs=10, k=8)  # shard_size 4 -> shards of 4, 4, 2 sequences


def _checksums(manifest) -> list[tuple[str, str, int]]:
    return [(s.name, s.checksum, s.bytes) for s in manifest.shards]


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_written_cache_reads_back_every_sequence(tmp_path, corpus, fmt):
    manifest = write_cache(tmp_path / "c", corpus, fmt=fmt)
    assert manifest.status == "complete" and [s.sequences for s in manifest.shards] == [4, 4, 2]
    assert sum(s.tokens for s in manifest.shards) == corpus.num_tokens
    reader = CacheReader(tmp_path / "c", expect_vocab_size=300, expect_tokenizer_hash="t0")
    assert len(reader) == reader.num_sequences == 10
    for i, seq in enumerate(reader):
        t = corpus.targets[i]
        np.testing.assert_array_equal(seq.input_ids, corpus.sequences[i])
        np.testing.assert_array_equal(seq.topk_ids, t.topk_ids)
        np.testing.assert_array_equal(seq.topk_logprobs, t.topk_logprobs)
        np.testing.assert_array_equal(seq.tail_logmass, t.tail_logmass)
        np.testing.assert_array_equal(seq.target_logprob, t.target_logprob)
    last = reader.sequence(-1, as_="torch")
    assert str(last.topk_ids.dtype) == "torch.int32" and last.topk_logprobs.shape == corpus.targets[-1].topk_ids.shape
    starts = [0]
    for index, input_ids, offsets, targets in reader.iter_shards():
        assert len(input_ids) == offsets[-1] == targets.num_positions
        starts.append(starts[-1] + len(offsets) - 1)
    assert starts == [0, 4, 8, 10]
    with pytest.raises(IndexError):
        reader.sequence(10)


@pytest.mark.parametrize("codec", codec_names())
def test_zarr_and_parquet_caches_read_the_same(tmp_path, corpus, codec):
    readers = [CacheReader(write_cache(tmp_path / fmt, corpus, fmt=fmt, codec=codec) and tmp_path / fmt)
               for fmt in FORMATS]
    for i in range(len(corpus.sequences)):
        a, b = (r.sequence(i) for r in readers)
        for field in ("input_ids", "topk_ids", "topk_logprobs", "tail_logmass", "target_logprob"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
        assert np.all(a.topk_logprobs[:, 1:] <= a.topk_logprobs[:, :-1])  # -inf from a quantiser is allowed
        if codec != "fp32":  # lossy codecs stay close to the teacher's probabilities
            np.testing.assert_allclose(np.exp(a.topk_logprobs), np.exp(corpus.targets[i].topk_logprobs), atol=1e-2)


def test_random_access_decodes_each_shard_once_per_visit(tmp_path, corpus, monkeypatch):
    write_cache(tmp_path / "c", corpus)
    reader = CacheReader(tmp_path / "c")
    reads = []
    original = reader._store.read
    monkeypatch.setattr(reader._store, "read", lambda p: reads.append(p.name) or original(p))
    for i in [0, 1, 2, 3, 4, 5, 1]:
        reader.sequence(i)
    assert reads == ["00000.zarr", "00001.zarr", "00000.zarr"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_after_abandoned_writer_is_byte_identical(tmp_path, corpus, fmt):
    clean = write_cache(tmp_path / "clean", corpus, fmt=fmt)
    spec = make_spec(corpus, fmt=fmt)
    writer = CacheWriter(tmp_path / "c", spec)
    writer.write_shard(2, *corpus.shard(2, 4))
    leftover = tmp_path / "c" / "shards" / f".00000.{fmt}.dead999.tmp"  # a distill.files temp name
    leftover.mkdir() if fmt == "zarr" else leftover.write_bytes(b"half a shard")
    del writer  # abandoned without finalize or close: the lock goes with the file object

    resumed = CacheWriter(tmp_path / "c", spec)
    assert not resumed.is_complete and resumed.done_shards() == {2}
    assert not leftover.exists()
    for i in sorted(set(range(resumed.num_shards)) - resumed.done_shards()):
        resumed.write_shard(i, *corpus.shard(i, 4))
    assert _checksums(resumed.finalize()) == _checksums(clean)
    assert verify_cache(tmp_path / "c").ok


def test_resume_after_killed_process_is_byte_identical(tmp_path, corpus):
    """A real crash: a child process writes shard 0, starts shard 1 and dies with os._exit."""
    clean = write_cache(tmp_path / "clean", corpus)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(make_spec(corpus)))
    child = textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_cache_synth import make_corpus
        from teacher_cache.writer import CacheWriter
        corpus = make_corpus(num_seqs=10, k=8)
        writer = CacheWriter({str(tmp_path / "c")!r}, json.load(open({str(spec_file)!r})))
        writer.write_shard(0, *corpus.shard(0, 4))
        def die(*a, **kw):
            os._exit(3)  # mid-shard: the temp directory is written, the rename never happens
        import teacher_cache.store_zarr as z
        z._fsync_files = die
        writer.write_shard(1, *corpus.shard(1, 4))
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert any(p.name.startswith(".00001.zarr.") and p.name.endswith(".tmp")
               for p in (tmp_path / "c" / "shards").iterdir())
    with pytest.raises(CacheError, match="incomplete"):
        CacheReader(tmp_path / "c")

    resumed = CacheWriter(tmp_path / "c", make_spec(corpus))
    assert resumed.done_shards() == {0}
    for i in (1, 2):
        resumed.write_shard(i, *corpus.shard(i, 4))
    assert _checksums(resumed.finalize()) == _checksums(clean)
    assert sorted(p.name for p in (tmp_path / "c" / "shards").iterdir()) == ["00000.zarr", "00001.zarr", "00002.zarr"]


def test_shards_written_from_threads_match_sequential(tmp_path, corpus):
    clean = write_cache(tmp_path / "clean", corpus)
    with CacheWriter(tmp_path / "c", make_spec(corpus)) as writer:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda i: writer.write_shard(i, *corpus.shard(i, 4)), [2, 0, 1]))
        assert _checksums(writer.finalize()) == _checksums(clean)


def test_second_writer_is_locked_out(tmp_path, corpus):
    first = CacheWriter(tmp_path / "c", make_spec(corpus))
    with pytest.raises(CacheLockedError, match=f"being written by another process \\(pid {os.getpid()}\\)"):
        CacheWriter(tmp_path / "c", make_spec(corpus))
    first.close()
    CacheWriter(tmp_path / "c", make_spec(corpus)).close()


def test_other_identity_is_refused_and_nothing_deleted(tmp_path, corpus):
    write_cache(tmp_path / "c", corpus)
    before = _snapshot(tmp_path / "c")
    with pytest.raises(CacheMismatchError) as err:
        CacheWriter(tmp_path / "c", make_spec(corpus, codec="bf16", teacher__weights_hash="w9"))
    message = str(err.value)
    assert "targets.value_codec: 'fp32' vs 'bf16'" in message and "teacher.weights_hash: 'w0' vs 'w9'" in message
    assert _snapshot(tmp_path / "c") == before


def test_complete_cache_is_reported_not_rewritten(tmp_path, corpus):
    manifest = write_cache(tmp_path / "c", corpus)
    before = _snapshot(tmp_path / "c")
    with CacheWriter(tmp_path / "c", make_spec(corpus)) as writer:
        assert writer.is_complete and writer.cache_id == manifest.cache_id
        assert writer.finalize() == manifest
        with pytest.raises(CacheError, match="already complete"):
            writer.write_shard(0, *corpus.shard(0, 4))
    assert _snapshot(tmp_path / "c") == before


def test_writer_refuses_bad_calls(tmp_path, corpus):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(CacheError, match="not empty .*notes.txt"):
        CacheWriter(tmp_path / "other", make_spec(corpus))
    with CacheWriter(tmp_path / "c", make_spec(corpus)) as writer:
        seqs, targets = corpus.shard(0, 4)
        with pytest.raises(CacheError, match="must hold 4 sequences, got 3"):
            writer.write_shard(0, seqs[:3], targets)
        with pytest.raises(CacheError, match=r"shard index must be in \[0, 3\), got 3"):
            writer.write_shard(3, seqs, targets)
        writer.write_shard(0, seqs, targets)
        with pytest.raises(CacheError, match="already written"):
            writer.write_shard(0, seqs, targets)
        with pytest.raises(CacheError, match="2 of 3 shards not written"):
            writer.finalize()


def test_reader_refuses_incomplete_foreign_or_newer_caches(tmp_path, corpus):
    with CacheWriter(tmp_path / "c", make_spec(corpus)) as writer:
        writer.write_shard(0, *corpus.shard(0, 4))
    with pytest.raises(CacheError, match=r"incomplete \(1 of 3 shards written\)"):
        CacheReader(tmp_path / "c")
    write_cache(tmp_path / "d", corpus)
    with pytest.raises(CacheMismatchError, match="vocab size 300, the student's has 512"):
        CacheReader(tmp_path / "d", expect_vocab_size=512)
    with pytest.raises(CacheMismatchError, match="tokenizer hash t0, the student's is t1"):
        CacheReader(tmp_path / "d", expect_tokenizer_hash="t1")
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    (tmp_path / "d" / "manifest.json").write_text(json.dumps({**manifest, "version": 4}))  # 2, 3: sampled, hybrid
    with pytest.raises(CacheError, match="version 4 is not supported"):
        CacheReader(tmp_path / "d")


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_shard_is_named_by_reader_and_verify(tmp_path, corpus, fmt, monkeypatch):
    write_cache(tmp_path / "c", corpus, fmt=fmt)
    shard = tmp_path / "c" / "shards" / f"00001.{fmt}"
    files = [shard] if shard.is_file() else [p for p in shard.rglob("*") if p.is_file()]
    victim = max(files, key=lambda p: p.stat().st_size)
    os.truncate(victim, victim.stat().st_size - 7)
    reader = CacheReader(tmp_path / "c")
    reader.sequence(0)  # shard 0 is intact
    with pytest.raises(CorruptShardError, match=f"shard 00001.{fmt} has .* bytes on disk"):
        reader.sequence(5)
    report = verify_cache(tmp_path / "c")
    assert not report.ok and report.first_bad == f"00001.{fmt}" and f"first bad shard 00001.{fmt}" in report.message
    # without the size and checksum checks, decoding itself still names the shard
    unchecked = CacheReader(tmp_path / "c", verify_checksums=False)
    monkeypatch.setattr(unchecked, "_check_shard_file", lambda *a: None)
    with pytest.raises(CorruptShardError, match=f"shard 00001.{fmt} cannot be decoded"):
        unchecked.sequence(5)


def test_same_size_damage_fails_the_checksum(tmp_path, corpus):
    write_cache(tmp_path / "c", corpus, fmt="parquet")
    victim = tmp_path / "c" / "shards" / "00002.parquet"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="shard 00002.parquet fails its checksum"):
        CacheReader(tmp_path / "c").sequence(9)
    bad = verify_cache(tmp_path / "c").bad
    assert bad == [("00002.parquet", "checksum differs from the manifest (damaged or modified)")]


def test_verify_reports_missing_shards_and_incomplete_caches(tmp_path, corpus):
    write_cache(tmp_path / "c", corpus, fmt="parquet")
    good = verify_cache(tmp_path / "c", deep=True)
    assert good.ok and good.shards_checked == 3 and good.message.startswith(f"{tmp_path / 'c'}: cache")
    (tmp_path / "c" / "shards" / "00001.parquet").unlink()
    report = verify_cache(tmp_path / "c")
    assert not report.ok and report.missing == ["00001.parquet"]
    assert "1 missing shard(s): 00001.parquet" in report.message
    with CacheWriter(tmp_path / "d", make_spec(corpus)) as writer:
        writer.write_shard(1, *corpus.shard(1, 4))
    partial = verify_cache(tmp_path / "d")
    assert not partial.ok and partial.missing == ["00000.zarr", "00002.zarr"] and "incomplete" in partial.message


def test_kill_inside_the_first_manifest_write_does_not_block_the_rerun(tmp_path, corpus):
    """A kill inside atomic_write_json leaves .manifest.json.XXXX.tmp and no manifest; the rerun
    removes it and claims the folder instead of refusing it as "not empty"."""
    cache = tmp_path / "c"
    cache.mkdir()
    (cache / "LOCK").write_text("12345")
    (cache / ".manifest.json.k1ll3d.tmp").write_text('{"format": "distill-tea')
    manifest = write_cache(cache, corpus)
    assert manifest.status == "complete"
    assert sorted(p.name for p in cache.iterdir()) == ["LOCK", "manifest.json", "shards"]
    # A file of anyone else's, or another tool's temp file, still makes the folder not ours.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".notes.tmp").write_text("mine")
    with pytest.raises(CacheError, match="not empty .*notes.tmp"):
        CacheWriter(tmp_path / "d", make_spec(corpus))
    assert (tmp_path / "d" / ".notes.tmp").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_shards_of_a_complete_cache_are_found_and_repaired(tmp_path, corpus, fmt):
    clean = write_cache(tmp_path / "clean", corpus, fmt=fmt)
    cache = tmp_path / "c"
    write_cache(cache, corpus, fmt=fmt)
    check_shards(cache)  # whole: no error
    damaged = cache / "shards" / f"00001.{fmt}"
    files = sorted(p for p in damaged.rglob("*") if p.is_file()) if damaged.is_dir() else [damaged]
    victim = max(files, key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-7])
    shutil.rmtree(cache / "shards" / f"00002.{fmt}") if fmt == "zarr" else (cache / "shards" / "00002.parquet").unlink()
    with pytest.raises(CorruptShardError) as info:
        check_shards(cache)
    assert f"00001.{fmt}" in str(info.value) and "rerun `distill cache-teacher`" in str(info.value)
    assert "rerun `distill cache-teacher`" in verify_cache(cache).message

    with CacheWriter(cache, make_spec(corpus, fmt=fmt)) as writer:
        assert writer.is_complete and writer.damaged_shards() == [1, 2]
        writer.repair([1, 2])
        assert not writer.is_complete and writer.done_shards() == {0}
        with pytest.raises(CacheError, match="incomplete"):
            CacheReader(cache)  # readers refuse it while it is being repaired
        for i in (1, 2):
            writer.write_shard(i, *corpus.shard(i, 4))
        assert _checksums(writer.finalize()) == _checksums(clean)
    check_shards(cache)
    assert verify_cache(cache, deep=True).ok


def test_check_shards_refuses_an_incomplete_cache(tmp_path, corpus):
    with CacheWriter(tmp_path / "c", make_spec(corpus)) as writer:
        writer.write_shard(0, *corpus.shard(0, 4))
    with pytest.raises(CacheError, match="incomplete") as info:
        check_shards(tmp_path / "c")
    assert not isinstance(info.value, CorruptShardError)


def test_cache_folder_that_cannot_be_one_is_refused_in_words(tmp_path, corpus):
    from distill.configs import ConfigError

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is an existing file") as info:
        CacheWriter(tmp_path / "file", make_spec(corpus))
    assert info.value.as_option().args[0].startswith("--out is an existing file")
    with pytest.raises(ConfigError, match="cannot be created: .*file is a file"):
        CacheWriter(tmp_path / "file" / "cache", make_spec(corpus))


def test_lock_taken_over_by_the_writer_and_an_unused_folder_removed(tmp_path, corpus):
    lock = CacheLock.acquire(tmp_path / "new")
    with pytest.raises(CacheLockedError):
        CacheLock.acquire(tmp_path / "new")
    lock.release()
    assert not (tmp_path / "new").exists()  # created for nothing: gone with the lock
    lock = CacheLock.acquire(tmp_path / "c")
    with CacheWriter(tmp_path / "c", make_spec(corpus), lock=lock) as writer:
        for i in range(writer.num_shards):
            writer.write_shard(i, *corpus.shard(i, 4))
        writer.finalize()
    assert not lock.held and verify_cache(tmp_path / "c").ok


def test_everything_written_honours_the_umask(tmp_path, corpus):
    old = os.umask(0o027)
    try:
        for fmt in FORMATS:
            write_cache(tmp_path / fmt, corpus, fmt=fmt)
    finally:
        os.umask(old)
    for fmt in FORMATS:
        for p in (tmp_path / fmt).rglob("*"):
            expected = 0o750 if p.is_dir() else 0o640
            assert p.stat().st_mode & 0o777 == expected, p
