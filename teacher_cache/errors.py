"""Errors of the cache format. Their base, `DistillUserError`, lives in `distill.errors`."""

from distill.errors import DistillUserError


class CacheError(DistillUserError):
    """A cache that cannot be read or written as asked."""


class CacheLockedError(CacheError):
    """Another writer holds the cache's LOCK."""


class CacheMismatchError(CacheError):
    """The cache directory holds another cache's data, or a cache that does not fit the reader."""


class CorruptShardError(CacheError):
    """A shard is missing, truncated or fails its checksum."""
