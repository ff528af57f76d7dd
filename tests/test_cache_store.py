"""Manifest (identity, strict loading, atomic writes) and the two shard stores (exact round trips)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from teacher_cache.codecs import codec_names, get_codec
from distill.files import atomic_write_json
from teacher_cache.errors import CacheError, CorruptShardError
from teacher_cache.manifest import (
    CacheSpec, Manifest, ShardInfo, load_manifest, manifest_path,
)
from teacher_cache.store import decode_shard, encode_shard, get_store, read_shard, shard_checksum
from test_cache_synth import make_corpus, make_spec

FORMATS = ("zarr", "parquet")


@pytest.fixture(scope="module")
def corpus():
    return make_corpus(num_seqs=6, k=8)


def _spec(corpus, **kw) -> CacheSpec:
    return CacheSpec.from_dict(make_spec(corpus, **kw))


# ---- manifest ----

def test_cache_id_covers_identity_fields_only(corpus):
    base = _spec(corpus)
    assert len(base.cache_id) == 16 and base.cache_id == _spec(corpus).cache_id
    changed = {"teacher__weights_hash": "w1", "teacher__backend": "vllm", "teacher__dtype": "bfloat16",
               "tokenizer__hash": "t1", "data__fingerprint": "f1", "data__seq_len": 32, "targets__k": 4,
               "targets__value_codec": "bf16", "targets__temperature": 2.0, "storage__format": "parquet",
               "storage__shard_size": 3}
    ids = {name: _spec(corpus, **{name: value}).cache_id for name, value in changed.items()}
    assert base.cache_id not in ids.values() and len(set(ids.values())) == len(ids)
    same = {"teacher__path": "/elsewhere", "data__source": "other description"}
    assert all(_spec(corpus, **{n: v}).cache_id == base.cache_id for n, v in same.items())
    assert _spec(corpus, targets__temperature=1).cache_id == base.cache_id  # int and float temperature agree


def test_manifest_round_trips_through_json(tmp_path, corpus):
    shard = ShardInfo(name="00000.zarr", sequences=4, tokens=40, checksum="sha256:ab", bytes=123)
    m = Manifest(spec=_spec(corpus), status="complete", shards=(shard,))
    atomic_write_json(manifest_path(tmp_path), m.to_dict())
    assert load_manifest(tmp_path) == m
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temp file left behind
    d = json.loads(manifest_path(tmp_path).read_text())
    assert d["format"] == "distill-teacher-cache" and d["version"] == 1 and d["cache_id"] == m.cache_id


@pytest.mark.parametrize("edit, expected", [
    (lambda d: d.update(version=4), "version 4 is not supported"),  # 2: a sampled cache, 3: a hybrid one
    (lambda d: d.update(format="other"), "not a distill teacher cache"),
    (lambda d: d["targets"].update(k=0), "targets.k must be an integer >= 1, got 0"),
    (lambda d: d["teacher"].update(colour="red"), "unknown key(s) ['colour']"),
    (lambda d: d["data"].pop("fingerprint"), "missing key(s) ['fingerprint']"),
    (lambda d: d["storage"].update(format="hdf5"), "storage.format must be one of zarr, parquet, got 'hdf5'"),
    (lambda d: d.update(cache_id="0" * 16), "edited by hand"),
    (lambda d: d.update(status="done"), "status must be one of"),
])
def test_manifest_loading_is_strict(tmp_path, corpus, edit, expected):
    d = Manifest(spec=_spec(corpus), status="incomplete").to_dict()
    edit(d)
    manifest_path(tmp_path).write_text(json.dumps(d))
    with pytest.raises(CacheError) as err:
        load_manifest(tmp_path)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_missing_or_garbled_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(CacheError, match="holds no manifest.json"):
        load_manifest(tmp_path)
    with pytest.raises(CacheError, match="^" + re.escape(f"{tmp_path / 'nope'} does not exist; check the path")):
        load_manifest(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(CacheError, match="^" + re.escape(f"{tmp_path / 'file'} is a file, not a cache folder")):
        load_manifest(tmp_path / "file")
    manifest_path(tmp_path).write_text('{"format": ')
    with pytest.raises(CacheError, match="not valid JSON"):
        load_manifest(tmp_path)


# ---- stores ----

def _shard_arrays(corpus, codec: str) -> dict[str, np.ndarray]:
    seqs, targets = corpus.shard(0, 6)
    return encode_shard(seqs, targets, get_codec(codec))


def _assert_arrays_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # NaNs compare equal here


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("codec", codec_names())
def test_store_round_trip_is_exact(tmp_path, corpus, fmt, codec):
    store = get_store(fmt)
    arrays = _shard_arrays(corpus, codec)
    path = tmp_path / f"00000{store.suffix}"
    store.write(path, arrays)
    back = store.read(path)
    _assert_arrays_equal(arrays, back)
    np.testing.assert_array_equal(store.read_offsets(path), arrays["seq_offsets"])

    input_ids, offsets, targets = decode_shard(back, get_codec(codec), path.name)
    seqs, original = corpus.shard(0, 6)
    np.testing.assert_array_equal(input_ids, np.concatenate(seqs))
    assert targets.topk_logprobs.dtype == np.float32 and targets.topk_ids.dtype == np.int32
    lp = targets.topk_logprobs
    assert np.all(lp[:, 1:] <= lp[:, :-1]), "ids must come back in descending probability"
    np.testing.assert_array_equal(targets.tail_logmass, original.tail_logmass)
    np.testing.assert_array_equal(targets.target_logprob, original.target_logprob)
    if codec == "fp32":
        np.testing.assert_array_equal(targets.topk_ids, original.topk_ids)
        np.testing.assert_array_equal(targets.topk_logprobs, original.topk_logprobs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_store_output_is_deterministic(tmp_path, corpus, fmt):
    store = get_store(fmt)
    arrays = _shard_arrays(corpus, "bf16")
    paths = [tmp_path / f"{i}{store.suffix}" for i in range(2)]
    for p in paths:
        store.write(p, arrays)
    assert shard_checksum(paths[0]) == shard_checksum(paths[1])
    arrays["tail_logmass"] = arrays["tail_logmass"].copy()
    arrays["tail_logmass"][3] += 1.0
    store.write(tmp_path / f"2{store.suffix}", arrays)
    assert shard_checksum(tmp_path / f"2{store.suffix}")[0] != shard_checksum(paths[0])[0]


def _largest_file(path):
    return path if path.is_file() else max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_shard_file_names_the_shard(tmp_path, corpus, fmt):
    store = get_store(fmt)
    path = tmp_path / f"00007{store.suffix}"
    store.write(path, _shard_arrays(corpus, "fp16"))
    victim = _largest_file(path)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CorruptShardError, match=f"shard 00007{store.suffix} cannot be decoded"):
        read_shard(store, path, path.name)


def test_zarr_chunk_checksum_catches_a_flipped_byte(tmp_path, corpus):
    store = get_store("zarr")
    path = tmp_path / "00000.zarr"
    store.write(path, _shard_arrays(corpus, "fp32"))
    victim = _largest_file(path)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="00000.zarr"):
        read_shard(store, path, path.name)


def test_generic_codec_arrays_survive_both_stores(tmp_path, corpus):
    """A codec may add arrays of other dtypes and shapes (per-row scales, uint8 codes)."""
    arrays = _shard_arrays(corpus, "fp32")
    n = len(arrays["input_ids"])
    arrays["row_scale"] = np.linspace(0, 1, n, dtype=np.float16)
    arrays["codes"] = np.arange(n * 6, dtype=np.uint8).reshape(n, 2, 3)
    for fmt in FORMATS:
        store = get_store(fmt)
        store.write(tmp_path / f"x{store.suffix}", arrays)
        _assert_arrays_equal(arrays, store.read(tmp_path / f"x{store.suffix}"))


def test_readme_decodes_a_shard_with_pyarrow_alone(tmp_path, corpus):
    """The README's cache format section is enough to read a sqrt8 shard without distill: its
    snippet, run as written, gives what CacheReader gives (Zarr: the same arrays by name)."""
    import re
    from pathlib import Path

    import zarr

    from teacher_cache.reader import CacheReader
    from test_cache_synth import write_cache

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("### Cache format v1"):]
    snippet = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    for fmt in FORMATS:
        write_cache(tmp_path / fmt, corpus, fmt=fmt, codec="sqrt8", shard_size=4)
    scope: dict = {}
    exec(snippet.replace("CACHE", str(tmp_path / "parquet")), scope)
    reader = CacheReader(tmp_path / "parquet")
    _, input_ids, seq_offsets, targets = next(reader.iter_shards())
    np.testing.assert_array_equal(scope["seq_offsets"], seq_offsets)
    np.testing.assert_array_equal(scope["topk_ids"], targets.topk_ids)
    np.testing.assert_allclose(scope["topk_logprobs"], targets.topk_logprobs, rtol=1e-6)
    group = zarr.open_group(str(tmp_path / "zarr" / "shards" / "00000.zarr"), mode="r")
    np.testing.assert_array_equal(group["seq_offsets"][:], seq_offsets)
    table = scope["table"]
    for name in ("topk_id_gaps", "topk_id_gaps_hi", "topk_sqrtp", "input_ids", "tail_logmass"):
        stored = table.column(name).combine_chunks()
        stored = (stored.flatten() if name.startswith("topk") else stored).to_numpy()
        np.testing.assert_array_equal(group[name][:].reshape(-1), stored, err_msg=name)


# ---- parquet: column chunks encoded on parallel threads, bytes as pyarrow writes them ----

def _pyarrow_reference(path, store, seq_offsets, blocks) -> None:
    """The shard as pq.ParquetWriter writes it: each row group's columns one after another."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from teacher_cache.row_blocks import RowBuffer
    from teacher_cache.store_parquet import _WRITE_OPTIONS, _column, _schema

    buffer, schema = RowBuffer(), _schema(blocks[0], seq_offsets)
    for block in blocks:
        buffer.add(block)
    group_rows = store._group_rows(blocks[0])
    with open(path, "wb") as f, pq.ParquetWriter(f, schema, **_WRITE_OPTIONS) as writer:
        while buffer.rows:
            rows = buffer.take(min(group_rows, buffer.rows))
            writer.write_table(pa.Table.from_arrays([_column(rows[field.name]) for field in schema], schema=schema),
                               row_group_size=len(rows["input_ids"]))


def _big_rows(codec: str, num_rows: int, k: int, sampled: bool, seed: int = 0) -> dict:
    """Rows large enough that every top-k column spans several pages."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((num_rows, 4 * k)), axis=1)[:, :k].astype(np.int32) * 37
    logits = rng.standard_normal((num_rows, k)).astype(np.float32) * 3
    logprobs = np.sort(logits - np.logaddexp.reduce(logits, axis=1, keepdims=True) - 0.1, axis=1)[:, ::-1]
    rows = {"input_ids": rng.integers(0, 49152, num_rows).astype(np.int32),
            "tail_logmass": np.log(rng.random(num_rows)).astype(np.float32),
            "target_logprob": -rng.random(num_rows).astype(np.float32),
            **get_codec(codec).encode(ids, logprobs)}
    if sampled:
        rows["sample_counts"] = rng.integers(0, 4, (num_rows, k)).astype(np.uint8)
        rows["proposal_logprobs"] = np.ascontiguousarray(logprobs)
    return rows


@pytest.mark.parametrize("codec,sampled,row_group_bytes", [
    ("sqrt8", False, None), ("fp16", False, None), ("bf16", True, None), ("fp32", False, None),
    ("sqrt8", True, 3 << 20),  # several row groups, cut inside blocks
])
def test_parquet_bytes_equal_pyarrow_writer(tmp_path, codec, sampled, row_group_bytes):
    from teacher_cache.store_parquet import ParquetStore

    rows = _big_rows(codec, 12_000, 32, sampled)
    cuts = [0, 1, 2_048, 5_000, 9_999, 12_000]
    blocks = [{name: value[a:b] for name, value in rows.items()} for a, b in zip(cuts, cuts[1:])]
    seq_offsets = np.array([0, 3, 5_000, 12_000], dtype=np.int64)
    kwargs = {} if row_group_bytes is None else {"row_group_bytes": row_group_bytes}
    for threads in (1, 8):
        ParquetStore(**kwargs, threads=threads).write_stream(tmp_path / f"ours{threads}.parquet", seq_offsets,
                                                             iter(blocks))
    _pyarrow_reference(tmp_path / "ref.parquet", ParquetStore(**kwargs), seq_offsets, blocks)
    ref = (tmp_path / "ref.parquet").read_bytes()
    assert (tmp_path / "ours1.parquet").read_bytes() == ref
    assert (tmp_path / "ours8.parquet").read_bytes() == ref
    import pyarrow.parquet as pq

    groups = pq.ParquetFile(tmp_path / "ours8.parquet").metadata.num_row_groups
    assert (groups > 1) == (row_group_bytes is not None)


def test_parquet_column_error_leaves_no_shard(tmp_path):
    """A column that fails to encode on its thread fails the write, and no file or temp file stays."""
    from teacher_cache.store_parquet import ParquetStore

    rows = _big_rows("sqrt8", 300, 8, False)
    blocks = [{k: v[:100] for k, v in rows.items()}, {k: v[100:] for k, v in rows.items() if k != "topk_sqrtp"}]
    with pytest.raises(KeyError, match="topk_sqrtp"):  # raised on that column's thread
        ParquetStore().write_stream(tmp_path / "00000.parquet", np.array([0, 300], dtype=np.int64), iter(blocks))
    assert list(tmp_path.iterdir()) == []
