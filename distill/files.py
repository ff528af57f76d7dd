"""Atomic writes: readers see the old file or the new one, never a part (a leaf: imports nothing
of ours). Everything written honours the process umask, like a plain `open`, so a cache or run
shared between users stays readable by them."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TEMP_MARK = ".tmp"  # every temp name made here contains it; `remove_stale_temps` finds them by it


def distill_home() -> Path:
    """Where distill keeps what it derives once per machine (imported teachers, tokenizer-pair maps):
    $DISTILL_HOME, else ~/.cache/distill."""
    return Path(os.environ.get("DISTILL_HOME", Path.home() / ".cache" / "distill"))


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    """Write `data` to `path` through a temp file in the same folder and a rename."""
    with atomic_file(path, durable=durable) as f:
        f.write(data)


@contextmanager
def atomic_file(path: str | os.PathLike, durable: bool = True) -> Iterator[Any]:
    """Yield a binary file open on a temp name beside `path`; on success it is flushed and renamed
    to `path`, on an error removed. For files written piece by piece, too large to hold at once."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_MARK, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str, durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), durable=durable)


def atomic_write_json(path: str | os.PathLike, obj: Any, durable: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n", durable=durable)


@contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temp folder beside `final`; on success it replaces `final` whole."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=TEMP_MARK, dir=final.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_dir(final.parent)


def remove_stale_temps(folder: str | os.PathLike) -> int:
    """Remove the temp files and folders these helpers left in `folder` (a kill mid-write); returns
    how many. Call it only while holding the folder (a lock, or a single writer)."""
    removed = 0
    for p in Path(folder).glob(f".*{TEMP_MARK}"):
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        removed += 1
    return removed


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_lock(path: str | os.PathLike, shared: bool = False):
    """Open `path` (created if missing) and take an flock on it without waiting: returns the open
    binary file, which holds the lock until it is closed (the kernel also drops it when the process
    dies, kill -9 included, so a lock is never stale), or None when another holder has it.

    A holder may remove the file before it lets go (`unlock_and_remove`); a lock taken on a file
    removed meanwhile is let go and taken again on the file now at `path`, so two takers never hold
    two different files of one name. OSError where the filesystem has no locks (ENOLCK, EOPNOTSUPP)
    or the folder cannot be written."""
    path = Path(path)
    while True:
        f = open(path, "a+b")
        try:
            fcntl.flock(f.fileno(), (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        except BaseException:
            f.close()
            raise
        try:
            if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                return f
        except FileNotFoundError:
            pass
        f.close()


def unlock_and_remove(lock_file, path: str | os.PathLike) -> None:
    """Remove the lock file at `path` while still holding its lock, then let go (see `try_lock`)."""
    try:
        Path(path).unlink(missing_ok=True)
    finally:
        lock_file.close()
