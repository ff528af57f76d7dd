"""The teacher's tokenizer files inside its cache (CACHE/tokenizer/): a cache alone then says what
bytes every cached token id stands for (teacher_cache/token_bytes.py), which a student with another
tokenizer needs to learn from it.

Stage one stores them once it has claimed the cache (``build.build_cache``) and lists them in the
manifest's tokenizer section (``files``: name -> "sha256:<hex>" of the file's bytes; not part of
the cache's identity). ``add_tokenizer`` (`distill add-tokenizer`) stores them in a cache built
before they were stored, or restores damaged ones, from a folder whose tokenizer hashes as the
cache's. ``load_cache_tokenizer`` checks them and loads the tokenizer.

Locally the folder is written under a temp name beside its final one and renamed
(``distill.files.atomic_dir``); on an object store, which has no rename, it is written locally and
uploaded, and, as for shards, the manifest written after it is what makes it count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from pathlib import Path

from distill.errors import DistillUserError
from distill.files import atomic_dir, try_lock
from teacher_cache.errors import CacheError, CacheLockedError, CacheMismatchError
from teacher_cache.identity import tokenizer_info
from teacher_cache.location import RemotePath, cache_location, write_json
from teacher_cache.manifest import LOCK_NAME, Manifest, load_manifest, manifest_path

TOKENIZER_DIR = "tokenizer"


def _restore_hint(cache_dir) -> str:
    return (f"restore them with `distill add-tokenizer {cache_dir} TEACHER_FOLDER` (the teacher the cache was "
            "built from)")


def save_tokenizer_files(tokenizer_or_folder, cache_dir: str | os.PathLike | RemotePath) -> dict:
    """Write the files ``save_pretrained`` writes for the tokenizer (tokenizer.json,
    tokenizer_config.json, a chat template, ...) into CACHE/tokenizer/, replacing what is there, and
    return the manifest's record of them: {"files": {name: "sha256:<hex>"}}.

    tokenizer_or_folder: an HF tokenizer, or a folder one is loaded from. The caller lists the
    record in the manifest (``CacheWriter.set_tokenizer_files``, ``add_tokenizer``).
    """
    tokenizer = tokenizer_or_folder
    if isinstance(tokenizer_or_folder, (str, os.PathLike)):
        tokenizer = _load_folder_tokenizer(Path(tokenizer_or_folder), "the tokenizer folder")
    final = cache_location(cache_dir) / TOKENIZER_DIR
    if isinstance(final, RemotePath):
        with tempfile.TemporaryDirectory(prefix="distill-tokenizer-") as staging:
            files = _save(tokenizer, Path(staging))
            final.remove()
            final.upload(Path(staging))
        return {"files": files}
    with atomic_dir(final) as staging:
        files = _save(tokenizer, staging)
    return {"files": files}


def _save(tokenizer, folder: Path) -> dict[str, str]:
    """``save_pretrained`` into ``folder``, each file flushed to disk; {relative name: checksum}."""
    tokenizer.save_pretrained(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with path.open("rb") as f:
            files[path.relative_to(folder).as_posix()] = _checksum(f.read())
            os.fsync(f.fileno())
    return files


def _checksum(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_tokenizer_files(cache_dir: str | os.PathLike | RemotePath, files: dict[str, str]) -> tuple[dict, list[str]]:
    """Read the stored tokenizer files the manifest lists as ``files`` (name -> checksum): returns
    ({name: bytes} of the whole ones, ["name: what is wrong"] for the missing or damaged ones)."""
    folder = cache_location(cache_dir) / TOKENIZER_DIR
    contents, problems = {}, []
    for name, checksum in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        with path.open("rb") as f:
            data = f.read()
        if _checksum(data) != checksum:
            problems.append(f"{name}: checksum differs from the manifest (damaged or modified)")
            continue
        contents[name] = data
    return contents, problems


def load_cache_tokenizer(cache_dir: str | os.PathLike | RemotePath):
    """The teacher's HF tokenizer as the cache at ``cache_dir`` stores it, once every file matches
    its checksum and the tokenizer hashes as the manifest's ``tokenizer.hash``; None for a cache
    that stores no tokenizer files (built before they were stored: ``add_tokenizer`` adds them).
    A missing or damaged file is a one-line ``CacheError`` saying how to restore them."""
    manifest = load_manifest(cache_dir)
    listed = manifest.spec.tokenizer.files
    if not listed:
        return None
    contents, problems = read_tokenizer_files(cache_dir, listed)
    where = f"{cache_location(cache_dir) / TOKENIZER_DIR}"
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CacheError(f"{where}: stored tokenizer file {problems[0]}{more}; {_restore_hint(cache_dir)}")
    with tempfile.TemporaryDirectory(prefix="distill-tokenizer-") as staging:
        for name, data in contents.items():  # loaded from the bytes just checked, whatever else is in the folder
            path = Path(staging) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        tokenizer = _load_folder_tokenizer(Path(staging), f"the tokenizer stored in {where}",
                                           _restore_hint(cache_dir), error=CacheError)
    stored_hash = tokenizer_info(tokenizer)["hash"]
    if stored_hash != manifest.spec.tokenizer.hash:
        raise CacheError(f"{where}: the stored tokenizer hashes {stored_hash}, the manifest's tokenizer.hash is "
                         f"{manifest.spec.tokenizer.hash}; {_restore_hint(cache_dir)}")
    return tokenizer


def add_tokenizer(cache_dir: str | os.PathLike | RemotePath, teacher_folder: str | os.PathLike) -> tuple[dict, bool]:
    """`distill add-tokenizer`: store the tokenizer of ``teacher_folder`` in the complete cache at
    ``cache_dir`` and list its files in the manifest; refused in one line, the cache untouched,
    unless the tokenizer hashes as the manifest's ``tokenizer.hash``. Nothing else in the cache
    changes (its ``cache_id`` neither). Returns (the manifest's record of the files, whether files
    listed before were replaced)."""
    path = cache_location(cache_dir)
    manifest = _complete_manifest(path)
    hint = f"give the teacher folder the cache was built from ({manifest.spec.teacher.path})"
    tokenizer = _load_folder_tokenizer(Path(teacher_folder), f"teacher folder {teacher_folder}", hint)
    asked = tokenizer_info(tokenizer)["hash"]
    _check_hash(manifest, asked, teacher_folder, hint)  # before the lock: a refusal leaves no lock file behind
    lock = _lock(path)
    try:
        manifest = _complete_manifest(path)  # as it is now that no writer can change it
        _check_hash(manifest, asked, teacher_folder, hint)
        record = save_tokenizer_files(tokenizer, path)
        tokenizer_section = dataclasses.replace(manifest.spec.tokenizer, files=record["files"])
        updated = dataclasses.replace(manifest, spec=dataclasses.replace(manifest.spec, tokenizer=tokenizer_section))
        write_json(manifest_path(path), updated.to_dict())
    finally:
        if lock is not None:
            lock.close()
    return record, bool(manifest.spec.tokenizer.files)


def _check_hash(manifest: Manifest, asked: str, teacher_folder, hint: str) -> None:
    if asked != manifest.spec.tokenizer.hash:
        raise CacheMismatchError(f"the tokenizer of {teacher_folder} (hash {asked}) is not the one cache "
                                 f"{manifest.cache_id} was built with (hash {manifest.spec.tokenizer.hash}); {hint}")


def _complete_manifest(path) -> Manifest:
    manifest = load_manifest(path)
    if manifest.status != "complete":
        raise CacheError(f"{path} is not complete (status {manifest.status!r}); finish it with the "
                         "`distill cache-teacher` command that built it, which stores the tokenizer files itself")
    return manifest


def _lock(path):
    """CACHE/LOCK, exclusively (what a stage-one writer holds), so no build rewrites the manifest
    meanwhile; None on an object store, which has no locks."""
    if isinstance(path, RemotePath):
        return None
    unwritable = f"{path}: add-tokenizer writes tokenizer/ and manifest.json there"
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheError(f"{unwritable}, and you cannot write to it; run it as a user who can (the cache's owner)")
    try:
        lock = try_lock(path / LOCK_NAME)
    except OSError as e:
        raise CacheError(f"{unwritable}, and it cannot be locked ({e.strerror}); run it as a user who can write "
                         "the cache") from None
    if lock is None:
        raise CacheLockedError(f"cache {path} is being written by another process (`distill cache-teacher`); "
                               "wait for it to finish, then add the tokenizer")
    return lock


def _load_folder_tokenizer(folder: Path, what: str, hint: str = "give a folder with tokenizer.json and "
                           "tokenizer_config.json", error: type[DistillUserError] = DistillUserError):
    """The HF tokenizer in ``folder``, or ``error`` in one line naming ``what`` and the ``hint``."""
    from transformers import AutoTokenizer

    if not folder.is_dir():
        raise error(f"{what} is not a folder; {hint}")
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise error(f"{what} holds no tokenizer transformers can load ({first}); {hint}") from None
