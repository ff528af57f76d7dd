"""Write a teacher cache: claim the directory, write shards atomically, write the manifest last.

Crash safety rests on three rules: a shard appears under its final name only by a rename of a
complete temp file or directory; the manifest says "complete" only after every shard is in place;
one process at a time holds CACHE/LOCK. So after any crash, the shards with final names are whole
and a rerun with the same identity resumes from them (and removes the temp files the crash left).
Shard bytes are a pure function of the inputs, so a resumed cache is byte-identical to an
uninterrupted one. A complete cache whose shards were damaged later is repaired the same way:
the damaged shards are deleted first, then the manifest goes back to "incomplete".

Several processes may write the shards of one cache at once (``teacher_cache.workers``): each
then holds CACHE/LOCK shared (a one-process writer holds it exclusively, so the two exclude each
other), writes only the shards it owns and removes only the temp names of those; the first to
arrive writes the "incomplete" manifest (a later one finds it and checks the identity), and one
process writes the complete manifest at the end.

The teacher's tokenizer files (CACHE/tokenizer/, teacher_cache/tokenizer_files.py) are stored once
the folder is claimed, and listed in the still incomplete manifest (``set_tokenizer_files``).

On an object store (an fsspec URL; teacher_cache/location.py) there is no rename and no lock:
a shard is written to a local temp folder and uploaded with its root object last (it counts as
written once that object exists), the manifest is one object written last, and one build at a
time writes a prefix.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from distill.configs import ConfigError
from distill.files import TEMP_MARK, fsync_dir, remove_stale_temps
from teacher_cache.codecs import get_codec
from teacher_cache.errors import OTHER_OUT, CacheError, CacheLockedError, CacheMismatchError
from teacher_cache.location import RemotePath, cache_location, present, write_json
from teacher_cache.manifest import (
    LOCK_NAME, MANIFEST_NAME, CacheSpec, Manifest, ShardInfo, StorageInfo, identity_diff, load_manifest,
    manifest_path, tool_version,
)
from teacher_cache.store import (
    ROW_ARRAYS, SHARDS_DIR, ShardStore, encode_blocks, get_store, shard_checksum, shard_name, shard_offsets,
)
from teacher_cache.targets import TeacherTargets


def check_cache_dir(path: str | os.PathLike) -> None:
    """Refuse, in words, a cache path that cannot hold a cache: an existing file, a folder without
    write permission, or a path that cannot be created. Raises ConfigError naming `out`. (An
    object store is not checked: its first write says.)"""
    path = cache_location(path)
    if isinstance(path, RemotePath):
        return
    if path.exists() and not path.is_dir():
        raise ConfigError("out", f"is an existing file ({path}); give a folder for the cache (new, or holding "
                                 "this cache)")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError("out", f"{path} cannot be created: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        problem = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        raise ConfigError("out", f"{path} {problem}; choose a folder you can write to")


class CacheLock:
    """CACHE/LOCK, held exclusively by one writer, or shared by the workers of a multi-process
    build (released when closed, also if the process dies).

    ``acquire`` creates the cache folder when needed; ``release`` removes a folder it created that
    still holds nothing but the lock, so a run refused before writing anything leaves nothing.
    """

    def __init__(self, path: Path, lock_file, created: bool, shared: bool = False):
        self.path, self._file, self._created, self.shared = path, lock_file, created, shared

    @classmethod
    def acquire(cls, cache_dir: str | os.PathLike, shared: bool = False) -> "CacheLock":
        path = cache_location(cache_dir)
        if isinstance(path, RemotePath):  # object stores have no locks (see the module doc)
            return cls(path, _NoLockFile(), created=False, shared=True)
        check_cache_dir(path)
        created = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock_file = open(path / LOCK_NAME, "a+")
        except OSError as e:
            raise ConfigError("out", f"{path}: cannot create the cache folder ({e.strerror}); choose another") from None
        try:
            fcntl.flock(lock_file.fileno(), (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            pid = lock_file.read().strip()
            lock_file.close()
            who = (f"another process (pid {pid})" if pid else
                   "the workers of a multi-process build (--num-workers or torchrun)")
            raise CacheLockedError(f"cache {path} is being written by {who}; wait for it or choose "
                                   f"{OTHER_OUT}") from None
        if shared:  # several holders: no pid to record
            return cls(path, lock_file, created, shared=True)
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(str(os.getpid()))
        lock_file.flush()
        return cls(path, lock_file, created)

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        if self._file is None:
            return
        if self._created and not self.shared and os.listdir(self.path) == [LOCK_NAME]:
            try:  # while still holding the lock, so no other writer's lock file goes
                (self.path / LOCK_NAME).unlink()
                self.path.rmdir()
            except OSError:
                pass
        self._file.close()
        self._file = None


class _NoLockFile:
    """The lock "file" of a cache on an object store: nothing to lock."""

    def close(self) -> None:
        pass


def check_claimable(path: str | os.PathLike) -> None:
    """A folder without a manifest may become a cache only if it holds nothing of anyone else's:
    nothing but the lock, an empty shards/ and a temp file of our own first manifest write."""
    path = cache_location(path)
    if not path.is_dir():
        return
    names = [p.name for p in path.iterdir() if p.name not in (LOCK_NAME, SHARDS_DIR)]
    others = sorted(n for n in names if not _is_own_manifest_temp(n))
    shards_dir = path / SHARDS_DIR
    if others or (shards_dir.exists() and any(shards_dir.iterdir())):
        shown = others[:3] or [SHARDS_DIR]
        raise CacheError(f"{path} is not empty ({', '.join(shown)} ...) and holds no {MANIFEST_NAME}; "
                         f"choose {OTHER_OUT}, new or empty")


def _is_own_manifest_temp(name: str) -> bool:
    return name.startswith(f".{MANIFEST_NAME}.") and name.endswith(TEMP_MARK)


class CacheWriter:
    """Writer of one cache directory.

    spec: a ``CacheSpec`` or the same as a nested dict {"teacher", "tokenizer", "data", "targets",
    "storage": {"format", "shard_size"}}; ``storage.codecs`` is filled in by the store.
    shard_size / storage_format, when given, override the spec's storage section.

    After construction, ``is_complete`` says whether the directory already holds this cache
    complete (then ``damaged_shards()`` says whether it needs a ``repair``), and ``done_shards()``
    which shards a resumed run can skip. ``write_shard`` may be called from a background thread;
    ``finalize`` writes the manifest. lock: a ``CacheLock`` already held on ``path`` (the writer
    takes it over and releases it on close); None acquires one. store: the ``ShardStore`` of the
    spec's format with other settings than the defaults (row group or chunk size), or None.
    owned_shards: None for a writer that owns the folder (it may remove any temp file and repair);
    else the shards this worker of a multi-process build writes (the others are written beside
    it: only the temp names of these are removed, and a folder claimed meanwhile is accepted).
    The spec's ``tokenizer.files`` is what the folder holds, not what is asked: an existing
    manifest's, none for a new cache, until ``set_tokenizer_files``.
    """

    def __init__(self, path: str | os.PathLike, spec: CacheSpec | dict, *, shard_size: int | None = None,
                 storage_format: str | None = None, lock: CacheLock | None = None, store: ShardStore | None = None,
                 owned_shards: list[int] | None = None):
        spec = spec if isinstance(spec, CacheSpec) else CacheSpec.from_dict(_with_storage_defaults(spec))
        store = store or get_store(storage_format or spec.storage.format)
        storage = StorageInfo(format=store.format, shard_size=shard_size or spec.storage.shard_size,
                              codecs=store.codecs())
        self.spec = dataclasses.replace(spec, storage=storage)
        self.path = cache_location(path)
        self._remote = isinstance(self.path, RemotePath)
        self._store = store
        self._codec = get_codec(self.spec.targets.value_codec)
        self._shards_dir = self.path / SHARDS_DIR
        self._written: dict[int, ShardInfo] = {}
        self._mutex = threading.Lock()
        self._owned = None if owned_shards is None else sorted(owned_shards)
        self._lock = lock if lock is not None else CacheLock.acquire(self.path, shared=owned_shards is not None)
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
        try:
            return self._claim_once()
        except CacheError:
            # A worker of the same build may have written the manifest since we looked: look again.
            if self._owned is None or not manifest_path(self.path).exists():
                raise
            return self._claim_once()

    def _claim_once(self) -> Manifest:
        if manifest_path(self.path).exists():
            existing = load_manifest(self.path)
            diff = identity_diff(existing.spec, self.spec)
            if diff:
                raise CacheMismatchError(
                    f"{self.path} holds another cache (cache_id {existing.cache_id}, asked for {self.cache_id}); "
                    f"differs in {'; '.join(diff)} (cache vs asked): choose {OTHER_OUT} or delete that "
                    "directory yourself")
            same_totals = (existing.spec.data.sequences, existing.spec.data.tokens) == (
                self.spec.data.sequences, self.spec.data.tokens)
            if not same_totals:
                raise CacheMismatchError(
                    f"{self.path}: cache {self.cache_id} has {existing.spec.data.sequences} sequences / "
                    f"{existing.spec.data.tokens} tokens but the same data fingerprint now gives "
                    f"{self.spec.data.sequences} / {self.spec.data.tokens}; the data fingerprint is not "
                    f"stable: choose {OTHER_OUT}")
            self._remove_stale_temps()
            self.spec = _with_tokenizer_files(self.spec, existing.spec.tokenizer.files)  # what the folder holds
            return existing
        check_claimable(self.path)
        self._remove_stale_temps()  # a kill inside the first manifest write leaves its temp file
        self._shards_dir.mkdir(exist_ok=True)
        self.spec = _with_tokenizer_files(self.spec, {})  # none stored yet: set_tokenizer_files records them
        manifest = Manifest(spec=self.spec, status="incomplete")
        write_json(manifest_path(self.path), manifest.to_dict())
        return manifest

    def _remove_stale_temps(self) -> None:
        """Temp files a killed writer left (we hold the lock, so none is being written); a worker
        removes only those of its own shards (the other workers' are being written). An object
        store has none (shards are staged locally); a partial upload is removed by ``write_shard``."""
        if self._remote:
            return
        if self._owned is None:
            remove_stale_temps(self.path)
            if self._shards_dir.is_dir():
                remove_stale_temps(self._shards_dir)
            return
        for index in self._owned:  # the temp names of distill.files: ".<final name>.<random><TEMP_MARK>"
            for stale in self._shards_dir.glob(f".{shard_name(index, self._store)}.*{TEMP_MARK}"):
                shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink(missing_ok=True)

    def damaged_shards(self) -> list[int]:
        """Indices of the shards of this complete cache that are missing or fail their size or checksum."""
        from teacher_cache.verify import damaged_shards

        return damaged_shards(self.path) if self.is_complete else []

    def repair(self, indices: list[int]) -> None:
        """Reopen this complete cache to rebuild the shards ``indices``: they are deleted first, then
        the manifest says "incomplete" until ``finalize`` (so a kill between the two leaves a
        complete manifest with missing shards, which the next run finds and repairs)."""
        if not self.is_complete:
            raise CacheError(f"cache {self.path} is not complete; resume it instead of repairing it")
        assert self._owned is None, "only a writer that owns the folder repairs it"
        for index in indices:
            path = self._shards_dir / shard_name(index, self._store)
            if self._remote:
                path.remove()
            elif path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        if not self._remote:
            fsync_dir(self._shards_dir)
        intact = {i: info for i, info in enumerate(self.manifest.shards) if i not in set(indices)}
        manifest = Manifest(spec=self.spec, status="incomplete", created=self.manifest.created)
        write_json(manifest_path(self.path), manifest.to_dict())
        self.manifest = manifest
        with self._mutex:
            self._written.update(intact)  # checked just now: finalize need not hash them again

    def set_tokenizer_files(self, files: dict[str, str]) -> None:
        """Record the tokenizer files just stored in CACHE/tokenizer/ (``tokenizer_files.save_tokenizer_files``):
        in the spec, and at once in the manifest (still incomplete), so that a job array's
        ``cache-merge``, which writes the complete manifest from it, keeps them too."""
        self._check_writable()
        self.spec = _with_tokenizer_files(self.spec, files)
        self.manifest = dataclasses.replace(self.manifest, spec=self.spec)
        write_json(manifest_path(self.path), self.manifest.to_dict())

    def done_shards(self) -> set[int]:
        """Indices of shards whose final name exists (complete by construction; on an object store,
        whose root object exists)."""
        root = self._store.root_file
        return {i for i in range(self.num_shards) if present(self._shards_dir / shard_name(i, self._store), root)}

    def write_shard(self, index: int, input_ids: list[np.ndarray],
                    targets: TeacherTargets | Iterable[TeacherTargets],
                    rows_of: dict[str, list[np.ndarray]] | None = None) -> ShardInfo:
        """Encode, compress and atomically place shard ``index``.

        input_ids: one int array [L_i] per sequence of the shard (``shard_size`` of them, fewer for
        the last shard); targets: sum(L_i) rows in the same order, whole or as an iterable of
        consecutive row blocks (cut anywhere, e.g. a backend's ``score_blocks``), which are
        encoded and written as they come, so a shard is never held whole. rows_of: a cache of
        generated text's per-row arrays (teacher_cache/store.py ``ROW_ARRAYS``), one [L_i] array per
        sequence each; required exactly when the manifest's data says the text was generated.
        Thread-safe.
        """
        self._check_writable()
        if not 0 <= index < self.num_shards:
            raise CacheError(f"shard index must be in [0, {self.num_shards}), got {index}")
        expected = self.spec.shard_sequences(index)
        if len(input_ids) != expected:
            raise CacheError(f"shard {index} must hold {expected} sequences, got {len(input_ids)}")
        name = shard_name(index, self._store)
        final = self._shards_dir / name
        if present(final, self._store.root_file):
            raise CacheError(f"shard {name} is already written in {self.path}; skip the indices in done_shards()")
        seq_offsets, all_ids = shard_offsets(input_ids)
        blocks = [targets] if isinstance(targets, TeacherTargets) else targets
        rows = encode_blocks(all_ids, self._checked_k(index, blocks), self._codec, self.spec.targets.head,
                             self._checked_rows(index, input_ids, rows_of))
        if self._remote:
            checksum, nbytes = self._upload_shard(final, seq_offsets, rows)
        else:
            self._store.write_stream(final, seq_offsets, rows)  # a temp name, fsync, rename
            checksum, nbytes = shard_checksum(final)
        info = ShardInfo(name=name, sequences=len(input_ids), tokens=len(all_ids), checksum=checksum, bytes=nbytes)
        with self._mutex:
            self._written[index] = info
        return info

    def _upload_shard(self, final: RemotePath, seq_offsets, rows) -> tuple[str, int]:
        """Write the shard in a local temp folder, hash it there, upload it with its root object last."""
        final.remove()  # what a killed upload left (no root object, so not counted as written)
        with tempfile.TemporaryDirectory(prefix="distill-shard-") as staging:
            local = Path(staging) / final.name
            self._store.write_stream(local, seq_offsets, rows)
            checksum = shard_checksum(local)
            final.upload(local, root_last=self._store.root_file)
        return checksum

    @property
    def written(self) -> dict[int, ShardInfo]:
        """The shards this writer wrote (or found whole when repairing), by index."""
        with self._mutex:
            return dict(self._written)

    def record_shards(self, infos: dict[int, ShardInfo]) -> None:
        """Shards other workers of the build wrote, as their ``written``: ``finalize`` need not
        read them back to hash them."""
        with self._mutex:
            self._written.update(infos)

    def _checked_rows(self, index: int, input_ids: list[np.ndarray],
                      rows_of: dict[str, list[np.ndarray]] | None) -> dict[str, np.ndarray] | None:
        """The shard's per-row arrays joined ([N] each), after checking they are the ones the cache's
        data calls for and cover its sequences row for row."""
        wanted = ROW_ARRAYS if self.spec.data.generated is not None else ()
        given = tuple(sorted(rows_of or {}))
        if given != tuple(sorted(wanted)):
            raise CacheError(f"shard {index} comes with per-row arrays {list(given)}, the cache's data needs "
                             f"{list(wanted)} (a cache of generated text has them, any other none)")
        if not wanted:
            return None
        lengths = [len(ids) for ids in input_ids]
        for name, parts in rows_of.items():
            if [len(p) for p in parts] != lengths:
                raise CacheError(f"shard {index}: {name} does not cover its sequences row for row")
        return {name: np.concatenate(parts).astype(np.uint8 if name == "loss_mask" else np.float32)
                for name, parts in rows_of.items()}

    def _checked_k(self, index: int, blocks: Iterable[TeacherTargets]):
        targets = self.spec.targets
        for block in blocks:
            if block.k != targets.k:
                raise CacheError(f"shard {index} targets have k={block.k}, the cache has k={targets.k}")
            if block.sampled != targets.sampled:
                raise CacheError(f"shard {index} targets are {'sampled' if block.sampled else 'top-k'}, the cache's "
                                 f"are {targets.kind}")
            if targets.sampled and (block.proposal_logprobs is None) != targets.proposal_is_teacher:
                has = "has" if block.proposal_logprobs is not None else "lacks"
                raise CacheError(f"shard {index} targets {has} proposal log-probs, but the cache's proposal "
                                 f"temperature is {targets.proposal_temperature:g} and its temperature "
                                 f"{targets.temperature:g} (they are stored exactly when the two differ)")
            yield block

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
        write_json(manifest_path(self.path), manifest.to_dict())
        self.manifest = manifest
        self.close()
        return manifest

    def _check_writable(self) -> None:
        if not self._lock.held:
            raise CacheError(f"writer of {self.path} is closed; open a new CacheWriter")
        if self.is_complete:
            raise CacheError(f"cache {self.path} ({self.cache_id}) is already complete; nothing to write")

    def close(self) -> None:
        """Release the lock; an unfinished cache stays "incomplete" and can be resumed."""
        if getattr(self, "_lock", None) is not None:
            self._lock.release()

    def __enter__(self) -> "CacheWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _with_tokenizer_files(spec: CacheSpec, files: dict[str, str]) -> CacheSpec:
    return dataclasses.replace(spec, tokenizer=dataclasses.replace(spec.tokenizer, files=dict(files)))


def _with_storage_defaults(spec: dict) -> dict:
    storage = dict(spec.get("storage") or {})
    storage.setdefault("codecs", {})
    return {**spec, "storage": storage}
