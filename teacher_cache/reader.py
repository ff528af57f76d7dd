"""Read a complete teacher cache, by sequence or by shard, in either storage format.

The manifest is checked before any shard is opened. Each shard is checked against the manifest
when first loaded (size always, checksum unless ``verify_checksums=False``), so a truncated or
damaged shard fails with ``CorruptShardError`` naming it rather than feeding a student garbage.
The last decoded shard is kept, so reading the sequences of a shard in turn decodes it once.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from teacher_cache.codecs import get_codec
from teacher_cache.errors import REPAIR_HINT, CacheError, CacheMismatchError, CorruptShardError
from teacher_cache.location import cache_location
from teacher_cache.manifest import Manifest, TargetsInfo, load_manifest
from teacher_cache.store import ROW_ARRAYS, SHARDS_DIR, decode_shard, get_store, read_shard, shard_checksum, shard_size_on_disk
from teacher_cache.targets import TeacherTargets


@dataclass
class CachedSequence:
    """One sequence of L positions; row t is the teacher's distribution over token t + 1."""

    input_ids: Any  # int32 [L]
    topk_ids: Any  # int32 [L, k], descending teacher probability
    topk_logprobs: Any  # float32 [L, k], full-vocabulary log-probs at the cache temperature
    tail_logmass: Any  # float32 [L]
    target_logprob: Any  # float32 [L], NaN on the last row
    sample_counts: Any = None  # uint8 [L, k] for a sampled cache (see TeacherTargets), else None
    proposal_logprobs: Any = None  # float32 [L, k] when a sampled cache's proposal is not the teacher


@dataclass
class DecodedShard:
    """One shard decoded and checked against the manifest (``CacheReader.load_shard``); its arrays
    are read-only, and sequence j is rows seq_offsets[j]:seq_offsets[j + 1] of every one."""

    index: int  # the shard's position in the manifest
    input_ids: np.ndarray  # int32 [N]
    seq_offsets: np.ndarray  # int64 [S + 1]
    targets: TeacherTargets  # N rows
    # a cache of generated text (manifest data.generated; teacher_cache/store.py ROW_ARRAYS):
    loss_mask: np.ndarray | None = None  # uint8 [N], 1 on the rows whose next token the policy wrote
    sampler_logprob: np.ndarray | None = None  # float32 [N], the sampler's log-prob of that token (NaN elsewhere)


def release_unused_memory() -> None:
    """Hand back to the system what Arrow's memory pool keeps after decoded shards are freed (a
    Parquet shard's arrays live in that pool, whose allocator keeps freed memory for reuse): after a
    one-off read, such as the offload planner's profile, so that what follows starts without it."""
    import sys

    if "pyarrow" in sys.modules:  # nothing read through Arrow yet: nothing to hand back
        sys.modules["pyarrow"].default_memory_pool().release_unused()


def check_target_arrays(targets: TeacherTargets, info: TargetsInfo, name: str) -> None:
    """A decoded shard's targets hold the arrays its manifest's targets section promises."""
    if targets.k != info.k:
        raise CorruptShardError(f"shard {name} has k={targets.k}, the manifest says {info.k}; rebuild the cache")
    expected = (info.sampled, info.sampled and not info.proposal_is_teacher)
    found = (targets.sample_counts is not None, targets.proposal_logprobs is not None)
    if found != expected:
        arrays = ", ".join(n for n, f in zip(("sample_counts", "proposal_logprobs"), found) if f) or "neither"
        raise CorruptShardError(f"shard {name} holds {arrays} of sample_counts and proposal_logprobs, which does not "
                                f"match its manifest's {info.kind} targets; rebuild the cache")


class CacheReader:
    """Reader of a complete cache.

    expect_vocab_size / expect_tokenizer_hash: the student's tokenizer; a cache built with another
    one is refused with ``CacheMismatchError``.
    """

    def __init__(self, path: str | os.PathLike, expect_vocab_size: int | None = None,
                 expect_tokenizer_hash: str | None = None, verify_checksums: bool = True):
        self.path = cache_location(path)
        self.manifest: Manifest = load_manifest(self.path)
        self.verify_checksums = verify_checksums
        spec = self.manifest.spec
        if self.manifest.status != "complete":
            written = sum(p.name[:1].isdigit() for p in (self.path / SHARDS_DIR).iterdir()) \
                if (self.path / SHARDS_DIR).exists() else 0
            raise CacheError(f"cache {self.path} is incomplete ({written} of {spec.num_shards} shards written); "
                             "finish it by running `distill cache-teacher` again with the same arguments")
        tok = spec.tokenizer
        if expect_vocab_size is not None and expect_vocab_size != tok.vocab_size:
            raise CacheMismatchError(f"cache {self.path} was built with a tokenizer of vocab size {tok.vocab_size}, "
                                     f"the student's has {expect_vocab_size}; build the cache with the student's "
                                     "tokenizer (teacher and student must share a vocabulary)")
        if expect_tokenizer_hash is not None and expect_tokenizer_hash != tok.hash:
            raise CacheMismatchError(f"cache {self.path} was built with tokenizer hash {tok.hash}, the student's is "
                                     f"{expect_tokenizer_hash}; build the cache with the student's tokenizer")
        shards = self.manifest.shards
        if len(shards) != spec.num_shards or sum(s.sequences for s in shards) != spec.data.sequences:
            raise CacheError(f"{self.path}/manifest.json lists {len(shards)} shards with "
                             f"{sum(s.sequences for s in shards)} sequences, expected {spec.num_shards} with "
                             f"{spec.data.sequences}; the manifest is damaged: rebuild the cache")
        self._store = get_store(spec.storage.format)
        self._codec = get_codec(spec.targets.value_codec)
        self._shard_starts = np.cumsum([0] + [s.sequences for s in shards]).tolist()
        self._verified: set[int] = set()
        self._last: DecodedShard | None = None

    @property
    def num_sequences(self) -> int:
        return self.manifest.spec.data.sequences

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    def __len__(self) -> int:
        return self.num_sequences

    def _check_shard_file(self, index: int, path: Path) -> None:
        info = self.manifest.shards[index]
        if not path.exists():
            raise CorruptShardError(f"shard {info.name} listed in {self.path}/manifest.json is missing; {REPAIR_HINT}")
        nbytes = shard_size_on_disk(path)
        if nbytes != info.bytes:
            raise CorruptShardError(f"shard {info.name} has {nbytes} bytes on disk, the manifest says {info.bytes}; "
                                    f"it is truncated or was modified: {REPAIR_HINT}")
        if self.verify_checksums and index not in self._verified:
            checksum, _ = shard_checksum(path)
            if checksum != info.checksum:
                raise CorruptShardError(f"shard {info.name} fails its checksum ({checksum[:19]}..., manifest "
                                        f"{info.checksum[:19]}...); it is damaged: {REPAIR_HINT}")
            self._verified.add(index)

    def load_shard(self, index: int) -> DecodedShard:
        """Shard ``index`` (0 <= index < num_shards) decoded, after its size (and checksum, unless
        ``verify_checksums=False``) is checked against the manifest; a damaged shard raises
        ``CorruptShardError`` naming it. The last shard loaded is kept, so loading it again is free."""
        if self._last is not None and self._last.index == index:
            return self._last
        info = self.manifest.shards[index]
        path = self.path / SHARDS_DIR / info.name
        self._check_shard_file(index, path)
        arrays = read_shard(self._store, path, info.name)
        input_ids, seq_offsets, targets = decode_shard(arrays, self._codec, info.name)
        if (len(seq_offsets) - 1, len(input_ids)) != (info.sequences, info.tokens):
            raise CorruptShardError(f"shard {info.name} holds {len(seq_offsets) - 1} sequences / {len(input_ids)} "
                                    f"tokens, the manifest says {info.sequences} / {info.tokens}; rebuild the cache")
        check_target_arrays(targets, self.manifest.spec.targets, info.name)
        generated = self.manifest.spec.data.generated is not None
        if any((name in arrays) != generated for name in ROW_ARRAYS):
            raise CorruptShardError(f"shard {info.name} {'lacks' if generated else 'holds'} the per-row arrays "
                                    f"{list(ROW_ARRAYS)} of a cache of generated text, which the manifest "
                                    f"{'calls' if generated else 'does not call'} for; rebuild the cache")
        rows_of = [arrays[name] for name in ROW_ARRAYS] if generated else [None, None]
        for a in (input_ids, seq_offsets, *targets.arrays, *rows_of):
            if a is not None:
                a.flags.writeable = False  # sequences are views into this cached shard
        self._last = DecodedShard(index, input_ids, seq_offsets, targets, *rows_of)
        return self._last

    def sequence(self, i: int, as_: str = "numpy") -> CachedSequence:
        """Sequence ``i`` (0 <= i < len(self)); ``as_="torch"`` returns CPU tensors (copies)."""
        if as_ not in ("numpy", "torch"):
            raise ValueError(f"as_ must be 'numpy' or 'torch', got {as_!r}")
        if not -self.num_sequences <= i < self.num_sequences:
            raise IndexError(f"sequence index must be in [0, {self.num_sequences}), got {i}")
        i %= self.num_sequences
        index = bisect.bisect_right(self._shard_starts, i) - 1
        shard = self.load_shard(index)
        local = i - self._shard_starts[index]
        start, stop = int(shard.seq_offsets[local]), int(shard.seq_offsets[local + 1])
        parts = (shard.input_ids[start:stop], *shard.targets.slice(start, stop).arrays)
        if as_ == "torch":
            # here, not at the top: `distill verify` and `cache-stats` read caches without torch
            import torch

            parts = tuple(None if p is None else torch.from_numpy(np.array(p)) for p in parts)
        return CachedSequence(*parts)

    def __getitem__(self, i: int) -> CachedSequence:
        return self.sequence(i)

    def __iter__(self) -> Iterator[CachedSequence]:
        for i in range(self.num_sequences):
            yield self.sequence(i)

    def iter_shards(self) -> Iterator[tuple[int, np.ndarray, np.ndarray, TeacherTargets]]:
        """(shard_index, input_ids int32 [N], seq_offsets int64 [S+1], TeacherTargets of N rows), in order."""
        for index in range(self.num_shards):
            shard = self.load_shard(index)
            yield index, shard.input_ids, shard.seq_offsets, shard.targets
