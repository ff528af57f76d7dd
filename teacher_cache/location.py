"""Where a cache lives: a local folder (a ``Path``), or a prefix on an object store given as an
fsspec URL (``s3://bucket/caches/qwen``, ``gs://...``; ``file:///abs/path`` is the local folder).

``RemotePath`` carries the few ``pathlib`` methods the cache code uses (``/``, ``exists``,
``iterdir``, ``read_text``, ...) over an fsspec filesystem, so writer, reader and verify keep one
code path; the shard stores read through zarr's and pyarrow's own fsspec support. Credentials and
endpoints come from fsspec's usual sources (environment variables such as AWS_ENDPOINT_URL and
AWS_PROFILE, or fsspec's config), never from the cache.

Object stores have no rename and no locks, so on them:
- a shard is written to a local temp folder (and hashed there), then uploaded with its root
  object last (a Parquet file is one object; a Zarr group's ``zarr.json`` goes after its arrays):
  a shard counts as written only once that root object exists, and a partial upload a kill left
  is removed before the shard is written again;
- the manifest is one object, written last, as it is locally: completion rests on it;
- nothing stops two builds writing one prefix at once: run one build (one job array, one
  torchrun) per prefix.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from distill.errors import DistillUserError
from distill.files import atomic_write_json

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class RemotePath:
    """A file or folder on an fsspec filesystem, with the pathlib methods the cache code uses."""

    def __init__(self, fs, path: str, protocol: str):
        self.fs, self.path, self.protocol = fs, path.rstrip("/"), protocol

    def __truediv__(self, name: str) -> "RemotePath":
        return RemotePath(self.fs, f"{self.path}/{name}", self.protocol)

    def __str__(self) -> str:
        return f"{self.protocol}://{self.path}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.path).suffix

    @property
    def parent(self) -> "RemotePath":
        return RemotePath(self.fs, str(PurePosixPath(self.path).parent), self.protocol)

    def expanduser(self) -> "RemotePath":
        return self

    def resolve(self) -> "RemotePath":
        return self

    def exists(self) -> bool:
        self.fs.invalidate_cache(self.path)  # another process may have written it since we listed
        return self.fs.exists(self.path)

    def is_file(self) -> bool:
        return self.exists() and self.fs.isfile(self.path)

    def is_dir(self) -> bool:
        return self.exists() and self.fs.isdir(self.path)

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> list["RemotePath"]:
        self.fs.invalidate_cache(self.path)
        if not self.fs.exists(self.path):
            return []
        return [self / PurePosixPath(p).name for p in self.fs.ls(self.path, detail=False)
                if p.rstrip("/") != self.path]

    def rglob(self, pattern: str) -> list["RemotePath"]:
        assert pattern == "*", "only rglob('*') (every file below) is supported"
        self.fs.invalidate_cache(self.path)
        return [RemotePath(self.fs, p, self.protocol) for p in self.fs.find(self.path)]

    def relative_to(self, other: "RemotePath") -> PurePosixPath:
        return PurePosixPath(self.path).relative_to(other.path)

    def open(self, mode: str = "rb"):
        return self.fs.open(self.path, mode)

    def size(self) -> int:
        return int(self.fs.size(self.path))

    def read_text(self) -> str:
        return self.fs.cat_file(self.path).decode()

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Object stores have no folders: a prefix exists once an object is under it."""

    def remove(self) -> None:
        """Delete this object, or every object under this prefix."""
        if self.exists():
            self.fs.rm(self.path, recursive=True)

    def upload(self, local: Path, root_last: str | None = None) -> None:
        """Copy the local file or folder ``local`` here; ``root_last``: the file of a folder
        uploaded after all the others (the one whose presence says the folder is whole)."""
        if local.is_file():
            self.fs.put_file(str(local), self.path)
            return
        files = sorted(p for p in local.rglob("*") if p.is_file())
        last = [p for p in files if root_last is not None and p.relative_to(local).as_posix() == root_last]
        for p in [p for p in files if p not in last] + last:
            self.fs.put_file(str(p), f"{self.path}/{p.relative_to(local).as_posix()}")
        self.fs.invalidate_cache(self.path)


def cache_location(path: str | os.PathLike | RemotePath) -> Path | RemotePath:
    """A local ``Path`` for a path or a ``file://`` URL, a ``RemotePath`` for any other URL."""
    if isinstance(path, (Path, RemotePath)):
        return path
    text = os.fspath(path)
    if "://" not in text:
        return Path(text)
    protocol, rest = text.split("://", 1)
    if protocol == "file":
        return Path(rest)
    import fsspec

    try:
        fs, fs_path = fsspec.core.url_to_fs(text)
    except ImportError as e:
        extra = _EXTRAS.get(protocol)
        hint = f"pip install 'distill[{extra}]'" if extra else f"pip install the fsspec package for {protocol}://"
        raise ImportError(f"cache URL {text}: {protocol}:// needs a package that is not installed ({e}); "
                          f"{hint}") from None
    except ValueError as e:
        raise DistillUserError(f"cache URL {text} is not one fsspec knows ({e}); give a local folder or an "
                               "s3://, gs:// or file:// URL") from None
    return RemotePath(fs, fs_path, protocol)


def is_remote(path) -> bool:
    return isinstance(path, RemotePath)


def absolute_cache(path: str | os.PathLike | RemotePath) -> str:
    """A cache path as a run records it: a URL as given, a local path made absolute."""
    where = cache_location(path)
    return str(where) if isinstance(where, RemotePath) else str(where.expanduser().resolve())


def write_json(path: Path | RemotePath, obj) -> None:
    """Locally an atomic write (temp name, rename); on an object store one object, which a
    reader sees whole or not at all."""
    if isinstance(path, RemotePath):
        import json

        path.fs.pipe_file(path.path, (json.dumps(obj, indent=2) + "\n").encode())
        path.fs.invalidate_cache(path.parent.path)
        return
    atomic_write_json(path, obj)


def present(path: Path | RemotePath, root_file: str | None) -> bool:
    """Whether the shard at ``path`` is written: its final name exists (locally it appears by a
    rename), or on an object store its root object (uploaded last) does."""
    if isinstance(path, RemotePath) and root_file is not None:
        return (path / root_file).exists()
    return path.exists()
