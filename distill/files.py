"""Atomic writes: readers see the old file or the new one, never a part (a leaf: imports nothing
of ours). Everything written honours the process umask, like a plain `open`, so a cache or run
shared between users stays readable by them."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TEMP_MARK = ".tmp"  # every temp name made here contains it; `remove_stale_temps` finds them by it


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
