"""Write a teacher cache: claim the directory, write shards atomically, write the manifest last.

Crash safety rests on three rules: a shard appears under its final name only by a rename of a
complete temp file or directory; the manifest says "complete" only after every shard is in place;
one process at a time holds CACHE/LOCK. So after any crash, the shards with final names are whole
and a rerun with the same identity resumes from them. Shard bytes are a pure function of the
inputs, so a resumed cache is byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import threading
import uuid
from pathlib import Path

import numpy as np

from teacher_cache.codecs import get_codec
from distill.files import atomic_write_json, fsync_dir
from teacher_cache.errors import CacheError, CacheLockedError, CacheMismatchError
from teacher_cache.manifest import (
    MANIFEST_NAME, CacheSpec, Manifest, ShardInfo, StorageInfo, identity_diff, load_manifest,
    manifest_path, tool_version,
)
from teacher_cache.store import (
    SHARDS_DIR, TEMP_PREFIX, encode_shard, get_store, shard_checksum, shard_name,
)
from teacher_cache.targets import TeacherTargets

LOCK_NAME = "LOCK"


def _acquire_lock(cache_dir: Path):
    """Hold CACHE/LOCK exclusively (released when the file closes, also if the process dies)."""
    lock_file = open(cache_dir / LOCK_NAME, "a+")
    try:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.seek(0)
        pid = lock_file.read().strip() or "unknown"
        lock_file.close()
        raise CacheLockedError(f"cache {cache_dir} is being written by another process (pid {pid}); "
                               "wait for it or choose another --out") from None
    lock_file.seek(0)
    lock_file.truncate()
    lock_file.write(str(os.getpid()))
    lock_file.flush()
    return lock_file


class CacheWriter:
    """Writer of one cache directory.

    spec: a ``CacheSpec`` or the same as a nested dict {"teacher", "tokenizer", "data", "targets",
    "storage": {"format", "shard_size"}}; ``storage.codecs`` is filled in by the store.
    shard_size / storage_format, when given, override the spec's storage section.

    After construction, ``is_complete`` says whether the directory already holds this cache
    complete (nothing to do), and ``done_shards()`` which shards a resumed run can skip.
    ``write_shard`` may be called from a background thread; ``finalize`` writes the manifest.
    """

    def __init__(self, path: str | os.PathLike, spec: CacheSpec | dict, *, shard_size: int | None = None,
                 storage_format: str | None = None):
        spec = spec if isinstance(spec, CacheSpec) else CacheSpec.from_dict(_with_storage_defaults(spec))
        store = get_store(storage_format or spec.storage.format)
        storage = StorageInfo(format=store.format, shard_size=shard_size or spec.storage.shard_size,
                              codecs=store.codecs())
        self.spec = dataclasses.replace(spec, storage=storage)
        self.path = Path(path)
        self._store = store
        self._codec = get_codec(self.spec.targets.value_codec)
        self._shards_dir = self.path / SHARDS_DIR
        self._written: dict[int, ShardInfo] = {}
        self._mutex = threading.Lock()
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_file = _acquire_lock(self.path)
        try:
            self.manifest = self._claim()
        except BaseException:
            self.close()
            raise

    @property
    def cache_id(self) -> str:
        return self.spec.cache_id

    @property
    def is_complete(self) -> bool:
        return self.manifest.status == "complete"

    @property
    def num_shards(self) -> int:
        return self.spec.num_shards

    def _claim(self) -> Manifest:
        if manifest_path(self.path).exists():
            existing = load_manifest(self.path)
            diff = identity_diff(existing.spec, self.spec)
            if diff:
                raise CacheMismatchError(
                    f"{self.path} holds another cache (cache_id {existing.cache_id}, asked for {self.cache_id}); "
                    f"differs in {'; '.join(diff)} (cache vs asked): choose another --out or delete that "
                    "directory yourself")
            same_totals = (existing.spec.data.sequences, existing.spec.data.tokens) == (
                self.spec.data.sequences, self.spec.data.tokens)
            if not same_totals:
                raise CacheMismatchError(
                    f"{self.path}: cache {self.cache_id} has {existing.spec.data.sequences} sequences / "
                    f"{existing.spec.data.tokens} tokens but the same data fingerprint now gives "
                    f"{self.spec.data.sequences} / {self.spec.data.tokens}; the data fingerprint is not "
                    "stable: choose another --out")
            if existing.status == "incomplete":
                self._remove_temp_leftovers()
            return existing
        others = sorted(p.name for p in self.path.iterdir() if p.name not in (LOCK_NAME, SHARDS_DIR))
        if others or (self._shards_dir.exists() and any(self._shards_dir.iterdir())):
            shown = others[:3] or [SHARDS_DIR]
            raise CacheError(f"{self.path} is not empty ({', '.join(shown)} ...) and holds no {MANIFEST_NAME}; "
                             "choose a new or empty directory for --out")
        self._shards_dir.mkdir(exist_ok=True)
        manifest = Manifest(spec=self.spec, status="incomplete")
        atomic_write_json(manifest_path(self.path), manifest.to_dict())
        return manifest

    def _remove_temp_leftovers(self) -> None:
        self._shards_dir.mkdir(exist_ok=True)
        for p in self._shards_dir.iterdir():
            if p.name.startswith(TEMP_PREFIX):
                shutil.rmtree(p) if p.is_dir() else p.unlink()

    def done_shards(self) -> set[int]:
        """Indices of shards whose final name exists (complete by construction)."""
        return {i for i in range(self.num_shards) if (self._shards_dir / shard_name(i, self._store)).exists()}

    def write_shard(self, index: int, input_ids: list[np.ndarray], targets: TeacherTargets) -> ShardInfo:
        """Encode, compress and atomically place shard ``index``.

        input_ids: one int array [L_i] per sequence of the shard (``shard_size`` of them, fewer for
        the last shard); targets: sum(L_i) rows in the same order. Thread-safe.
        """
        self._check_writable()
        if not 0 <= index < self.num_shards:
            raise CacheError(f"shard index must be in [0, {self.num_shards}), got {index}")
        expected = self.spec.shard_sequences(index)
        if len(input_ids) != expected:
            raise CacheError(f"shard {index} must hold {expected} sequences, got {len(input_ids)}")
        if targets.k != self.spec.targets.k:
            raise CacheError(f"shard {index} targets have k={targets.k}, the cache has k={self.spec.targets.k}")
        name = shard_name(index, self._store)
        final = self._shards_dir / name
        if final.exists():
            raise CacheError(f"shard {name} is already written in {self.path}; skip the indices in done_shards()")
        arrays = encode_shard(input_ids, targets, self._codec)
        tmp = self._shards_dir / f"{TEMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self._store.write(tmp, arrays)
            checksum, nbytes = shard_checksum(tmp, fsync=True)
            os.rename(tmp, final)
        except BaseException:
            if tmp.exists():
                shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
            raise
        fsync_dir(self._shards_dir)
        info = ShardInfo(name=name, sequences=len(input_ids), tokens=len(arrays["input_ids"]), checksum=checksum,
                         bytes=nbytes)
        with self._mutex:
            self._written[index] = info
        return info

    def _shard_info_from_disk(self, index: int) -> ShardInfo:
        """For shards an earlier (interrupted) process wrote."""
        name = shard_name(index, self._store)
        path = self._shards_dir / name
        checksum, nbytes = shard_checksum(path)
        offsets = self._store.read_offsets(path)
        return ShardInfo(name=name, sequences=len(offsets) - 1, tokens=int(offsets[-1]), checksum=checksum,
                         bytes=nbytes)

    def finalize(self) -> Manifest:
        """Check every shard is in place and the totals add up, then write the manifest as complete."""
        if self.is_complete:
            return self.manifest
        self._check_writable()
        missing = sorted(set(range(self.num_shards)) - self.done_shards())
        if missing:
            shown = ", ".join(str(i) for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise CacheError(f"cannot finalize {self.path}: {len(missing)} of {self.num_shards} shards not written "
                             f"({shown}); write them first")
        with self._mutex:
            written = dict(self._written)
        shards = [written.get(i) or self._shard_info_from_disk(i) for i in range(self.num_shards)]
        sequences, tokens = sum(s.sequences for s in shards), sum(s.tokens for s in shards)
        if (sequences, tokens) != (self.spec.data.sequences, self.spec.data.tokens):
            raise CacheError(f"cannot finalize {self.path}: shards hold {sequences} sequences / {tokens} tokens, "
                             f"the data section says {self.spec.data.sequences} / {self.spec.data.tokens}")
        manifest = dataclasses.replace(self.manifest, spec=self.spec, status="complete", shards=tuple(shards),
                                       tool_version=tool_version())
        atomic_write_json(manifest_path(self.path), manifest.to_dict())
        self.manifest = manifest
        self.close()
        return manifest

    def _check_writable(self) -> None:
        if self._lock_file is None:
            raise CacheError(f"writer of {self.path} is closed; open a new CacheWriter")
        if self.is_complete:
            raise CacheError(f"cache {self.path} ({self.cache_id}) is already complete; nothing to write")

    def close(self) -> None:
        """Release the lock; an unfinished cache stays "incomplete" and can be resumed."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> "CacheWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _with_storage_defaults(spec: dict) -> dict:
    storage = dict(spec.get("storage") or {})
    storage.setdefault("codecs", {})
    return {**spec, "storage": storage}
