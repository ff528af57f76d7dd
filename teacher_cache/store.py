"""What a shard holds, independent of the file format, and the helpers both stores share.

A shard is the positions of ``shard_size`` consecutive sequences, as a dict of named arrays whose
first axis is N (positions) except ``seq_offsets`` [S + 1]:

    input_ids int32 [N], seq_offsets int64 [S + 1], tail_logmass float32 [N],
    target_logprob float32 [N], and the value codec's arrays (fp32/bf16/fp16: topk_ids,
    topk_logprobs; sqrt8: topk_id_gaps, topk_id_gaps_hi, topk_sqrtp; see teacher_cache/codecs.py).

A sampled cache's shard also holds ``sample_counts`` uint8 [N, S] and, when the proposal is not
the teacher, ``proposal_logprobs`` float32 [N, S]. Its rows are stored with the ids of each row
ascending in every [N, S] array (so the counts stay aligned with the ids whatever order a codec
stores them in); decoding puts the slots back in cache order (count descending, then id).

A hybrid (topk+sampled) cache's shard holds the exact top-K as a top-k cache's codec arrays
([N, K], rank order), and its drawn slots as a sampled shard's arrays ([N, S], ascending ids)
with the codec's array names prefixed ``drawn_``; ``sample_counts`` and ``proposal_logprobs``
are [N, S], aligned with the drawn slots. Decoding joins them into K + S slots per row (the
top-K's counts 0, their proposal log-probs -inf: the draws never come from them).

A cache of generated text (`distill generate`, scored by stage one) holds two more per-row arrays:
``loss_mask`` uint8 [N], 1 on the rows whose next token the policy wrote (a completion's), 0 on
the prompt's rows and each sequence's last; and ``sampler_logprob`` float32 [N], on those rows the
log-probability with which the sampler drew the next token, NaN elsewhere (``ROW_ARRAYS``).

The codec's arrays are treated generically (any names, dtypes and trailing shape), so a codec
that adds per-row scales needs no change here. A ``ShardStore`` (Zarr or Parquet) turns that dict
into files and back, losslessly; where each store keeps ``seq_offsets`` is in its module doc and
the README's cache format section.

A shard is written as a stream of row blocks (``write_stream``): consecutive rows of every
N-axis array, cut anywhere. Stores regroup them (``teacher_cache.row_blocks``) into Parquet row
groups / Zarr chunks of a size fixed by the store alone, so the bytes of a shard do not depend on
how its rows arrived, and a writer holds about one row group or chunk per array, whatever the
length of a sequence.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np

from teacher_cache.codecs import ValueCodec
from teacher_cache.errors import REPAIR_HINT, CacheError, CorruptShardError
from teacher_cache.location import RemotePath
from teacher_cache.store_parquet import ParquetStore
from teacher_cache.store_zarr import ZarrStore
from teacher_cache.targets import TeacherTargets, canonical_slots

SHARDS_DIR = "shards"
FIXED_ARRAYS = ("input_ids", "seq_offsets", "tail_logmass", "target_logprob")
SAMPLED_ARRAYS = ("sample_counts", "proposal_logprobs")  # a sampled cache's, beside the codec's
ROW_ARRAYS = ("loss_mask", "sampler_logprob")  # a cache of generated text's, per row (module doc)
DRAWN_PREFIX = "drawn_"  # a hybrid shard's codec arrays of the drawn slots (the top-K's are unprefixed)


class ShardStore(Protocol):
    format: str  # "zarr" | "parquet"
    suffix: str  # ".zarr" | ".parquet"
    # the file of a shard folder uploaded last to an object store, whose presence says the shard
    # is whole there (teacher_cache/location.py); None for a one-file shard
    root_file: str | None

    def codecs(self) -> dict:
        """The lossless compression used, for the manifest's storage.codecs."""
        ...

    def write(self, path: Path, arrays: dict[str, np.ndarray]) -> None:
        """``write_stream`` of the whole shard ``arrays`` as one block."""
        ...

    def write_stream(self, path: Path, seq_offsets: np.ndarray, blocks: Iterable[dict[str, np.ndarray]]) -> None:
        """Create ``path`` (which does not exist) holding the shard whose sequences ``seq_offsets``
        int64 [S + 1] delimits and whose N = seq_offsets[-1] rows arrive in ``blocks`` (each a dict
        of every N-axis array, consecutive rows), atomically and durably: written under a temp name
        of ``distill.files`` (found by its ``remove_stale_temps`` after a kill), flushed to disk,
        then renamed, so ``path`` is whole or absent. An error raised by ``blocks``, or blocks that
        do not add up to N rows, leave nothing."""
        ...

    def read(self, path: Path) -> dict[str, np.ndarray]:
        """All arrays of the shard at ``path``; library errors propagate (see ``read_shard``)."""
        ...

    def read_offsets(self, path: Path) -> np.ndarray:
        """Only ``seq_offsets`` int64 [S + 1], without decoding the rest."""
        ...


def get_store(storage_format: str) -> ShardStore:
    """The store of ``storage_format`` ("zarr" | "parquet"), with its default settings."""
    if storage_format == "zarr":
        return ZarrStore()
    if storage_format == "parquet":
        return ParquetStore()
    raise CacheError(f"storage format must be zarr or parquet, got {storage_format!r}")


def shard_name(index: int, store: ShardStore) -> str:
    return f"{index:05d}{store.suffix}"


def encode_shard(input_ids: list[np.ndarray], targets: TeacherTargets, codec: ValueCodec,
                 head: int = 0) -> dict[str, np.ndarray]:
    """input_ids: one int array [L_i] per sequence; targets: sum(L_i) rows; head: a hybrid cache's
    exact top-K slots at the front of each row (0: none). Returns the shard's arrays."""
    seq_offsets, all_ids = shard_offsets(input_ids)
    blocks = list(encode_blocks(all_ids, [targets], codec, head))
    return {"seq_offsets": seq_offsets, **blocks[0]}


def shard_offsets(input_ids: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(seq_offsets int64 [S + 1], input_ids int32 [N]) of a shard's sequences."""
    lengths = np.array([len(s) for s in input_ids], dtype=np.int64)
    seq_offsets = np.zeros(len(input_ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=seq_offsets[1:])
    return seq_offsets, np.concatenate([np.asarray(s) for s in input_ids]).astype(np.int32, copy=False)


def encode_blocks(input_ids: np.ndarray, targets: Iterable[TeacherTargets],
                  codec: ValueCodec, head: int = 0, rows_of: dict[str, np.ndarray] | None = None
                  ) -> Iterator[dict[str, np.ndarray]]:
    """The row blocks of a shard for ``ShardStore.write_stream``, one per block of ``targets``.

    input_ids: int32 [N], the shard's tokens; targets: consecutive row blocks, N rows in all (a
    CacheError, raised into the store's write, when they are more or fewer). head: the exact
    top-K slots at the front of each row of a hybrid cache's sampled targets (0: none). rows_of:
    the shard's ``ROW_ARRAYS`` ([N] each), for a cache of generated text; None: none.
    """
    rows_of = rows_of or {}
    n, start = len(input_ids), 0
    for block in targets:
        stop = start + block.num_positions
        if stop > n:
            raise CacheError(f"shard has {n} tokens in its sequences but more target rows; "
                             "the backend returned targets for other sequences")
        rows = {
            "input_ids": input_ids[start:stop],
            "tail_logmass": np.ascontiguousarray(block.tail_logmass, dtype=np.float32),
            "target_logprob": np.ascontiguousarray(block.target_logprob, dtype=np.float32),
            **{name: np.ascontiguousarray(value[start:stop]) for name, value in rows_of.items()},
        }
        ids, logprobs, prefix = block.topk_ids, block.topk_logprobs, ""
        counts, proposal = block.sample_counts, block.proposal_logprobs
        if head:
            assert block.sampled, "a hybrid cache's targets carry sample counts"
            _put_codec_arrays(rows, codec, ids[:, :head], logprobs[:, :head], "", stop - start)
            ids, logprobs, counts = ids[:, head:], logprobs[:, head:], counts[:, head:]
            proposal = None if proposal is None else proposal[:, head:]
            prefix = DRAWN_PREFIX
        if block.sampled:
            by_id = np.argsort(ids, axis=1, kind="stable")
            ids, logprobs = np.take_along_axis(ids, by_id, 1), np.take_along_axis(logprobs, by_id, 1)
            rows["sample_counts"] = np.ascontiguousarray(np.take_along_axis(counts, by_id, 1), dtype=np.uint8)
            if proposal is not None:
                rows["proposal_logprobs"] = np.ascontiguousarray(np.take_along_axis(proposal, by_id, 1),
                                                                 dtype=np.float32)
        _put_codec_arrays(rows, codec, ids, logprobs, prefix, stop - start)
        yield rows
        start = stop
    if start != n:
        raise CacheError(f"shard has {n} tokens in its sequences but {start} target rows; "
                         "the backend returned targets for other sequences")


def _put_codec_arrays(rows: dict, codec: ValueCodec, ids: np.ndarray, logprobs: np.ndarray, prefix: str,
                      num_rows: int) -> None:
    for key, value in codec.encode(ids, logprobs).items():
        assert key not in FIXED_ARRAYS + SAMPLED_ARRAYS + ROW_ARRAYS and not key.startswith(DRAWN_PREFIX), \
            f"codec {codec.name} array name {key!r} clashes"
        assert value.shape[0] == num_rows, f"codec {codec.name} array {key} has {value.shape[0]} rows"
        rows[prefix + key] = np.ascontiguousarray(value)


def decode_shard(arrays: dict[str, np.ndarray], codec: ValueCodec,
                 name: str) -> tuple[np.ndarray, np.ndarray, TeacherTargets]:
    """Inverse of ``encode_shard``: (input_ids int32 [N], seq_offsets int64 [S+1], TeacherTargets)."""
    missing = [key for key in FIXED_ARRAYS if key not in arrays]
    if missing:
        raise CorruptShardError(f"shard {name} lacks array(s) {missing}; the cache is damaged: {REPAIR_HINT}")
    input_ids, seq_offsets = arrays["input_ids"], arrays["seq_offsets"]
    n = len(input_ids)
    ok = (len(seq_offsets) >= 2 and seq_offsets[0] == 0 and seq_offsets[-1] == n
          and bool(np.all(np.diff(seq_offsets) > 0)))
    sizes_ok = all(a.shape[0] == n for key, a in arrays.items() if key != "seq_offsets")
    if not (ok and sizes_ok):
        raise CorruptShardError(f"shard {name} has inconsistent array lengths or sequence offsets; "
                                f"the cache is damaged: {REPAIR_HINT}")
    drawn = {k[len(DRAWN_PREFIX):]: v for k, v in arrays.items() if k.startswith(DRAWN_PREFIX)}
    head_ids = head_logprobs = None
    try:
        topk_ids, topk_logprobs = codec.decode({k: v for k, v in arrays.items()
                                                if k not in FIXED_ARRAYS + SAMPLED_ARRAYS + ROW_ARRAYS
                                                and not k.startswith(DRAWN_PREFIX)})
        if drawn:  # a hybrid shard: the unprefixed arrays are its exact top-K
            head_ids, head_logprobs = topk_ids, topk_logprobs
            topk_ids, topk_logprobs = codec.decode(drawn)
    except KeyError as e:
        raise CorruptShardError(f"shard {name} lacks array {e} that value codec {codec.name!r} needs; "
                                f"the cache is damaged: {REPAIR_HINT}") from e
    counts, proposal = arrays.get("sample_counts"), arrays.get("proposal_logprobs")
    if drawn and counts is None:
        raise CorruptShardError(f"shard {name} has drawn slots but no sample_counts; the cache is damaged: "
                                f"{REPAIR_HINT}")
    if counts is not None:
        # The stored rows are in ascending-id order; the codec may have returned another.
        by_id = np.argsort(topk_ids, axis=1, kind="stable")
        topk_ids, topk_logprobs = np.take_along_axis(topk_ids, by_id, 1), np.take_along_axis(topk_logprobs, by_id, 1)
        order = canonical_slots(topk_ids, counts)
        topk_ids, topk_logprobs = np.take_along_axis(topk_ids, order, 1), np.take_along_axis(topk_logprobs, order, 1)
        counts = np.take_along_axis(counts, order, 1)
        if proposal is not None:
            proposal = np.take_along_axis(proposal, order, 1)
    elif proposal is not None:
        raise CorruptShardError(f"shard {name} has proposal_logprobs but no sample_counts; the cache is damaged: "
                                f"{REPAIR_HINT}")
    if head_ids is not None:
        n_head = head_ids.shape[1]
        topk_ids = np.concatenate([head_ids, topk_ids], 1)
        topk_logprobs = np.concatenate([head_logprobs, topk_logprobs], 1)
        counts = np.concatenate([np.zeros((n, n_head), counts.dtype), counts], 1)
        if proposal is not None:
            proposal = np.concatenate([np.full((n, n_head), -np.inf, proposal.dtype), proposal], 1)
    targets = TeacherTargets(topk_ids, topk_logprobs, arrays["tail_logmass"], arrays["target_logprob"], counts,
                             proposal)
    return input_ids, seq_offsets, targets


def shard_files(path: Path | RemotePath) -> list[tuple[str, Path | RemotePath]]:
    """(relative name, file) for every file of a shard, in a fixed order ("." for a one-file shard);
    the same names locally and on an object store."""
    if isinstance(path, RemotePath):
        files = path.rglob("*")  # objects only
        if [f.path for f in files] == [path.path]:
            return [(".", path)]
    elif path.is_file():
        return [(".", path)]
    else:
        files = [p for p in path.rglob("*") if p.is_file()]
    return sorted(((p.relative_to(path).as_posix(), p) for p in files), key=lambda item: item[0])


def _file_size(path: Path | RemotePath) -> int:
    return path.size() if isinstance(path, RemotePath) else path.stat().st_size


def shard_size_on_disk(path: Path | RemotePath) -> int:
    return sum(_file_size(p) for _, p in shard_files(path))


def shard_checksum(path: Path, fsync: bool = False) -> tuple[str, int]:
    """("sha256:<hex>", bytes) over the shard's files: each file's relative name, size and content.

    Names and sizes are hashed too, so a renamed or emptied chunk file changes the checksum.
    ``fsync=True`` also flushes each file to disk, which a store does before the rename.
    """
    h = hashlib.sha256()
    total = 0
    for rel, p in shard_files(path):
        with p.open("rb") as f:
            size = _file_size(p) if isinstance(p, RemotePath) else os.fstat(f.fileno()).st_size
            h.update(f"{rel}\0{size}\0".encode())
            while chunk := f.read(1 << 22):
                h.update(chunk)
            if fsync:
                os.fsync(f.fileno())
        total += size
    return f"sha256:{h.hexdigest()}", total


def read_shard(store: ShardStore, path: Path, name: str) -> dict[str, np.ndarray]:
    """``store.read`` with every decoding failure turned into a ``CorruptShardError`` naming the shard."""
    if not path.exists():
        raise CorruptShardError(f"shard {name} is missing from {path.parent}; the cache is damaged: {REPAIR_HINT}")
    try:
        return store.read(path)
    # Zarr, Blosc and Arrow raise many unrelated types for a damaged file (ValueError,
    # RuntimeError, OSError, KeyError, TypeError, JSON errors); all of them mean the same here.
    except Exception as e:
        raise CorruptShardError(f"shard {name} cannot be decoded ({type(e).__name__}: {e}); it is truncated or "
                                f"damaged: {REPAIR_HINT}") from e
