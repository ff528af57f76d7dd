"""Errors a user can cause. The CLI prints their message as one line and exits non-zero."""


class DistillUserError(ValueError):
    """A mistake the user can fix: the message says what was wrong and what to do."""


class CacheError(DistillUserError):
    """A cache that cannot be read or written as asked."""


class CacheLockedError(CacheError):
    """Another writer holds the cache's LOCK."""


class CacheMismatchError(CacheError):
    """The cache directory holds another cache's data, or a cache that does not fit the reader."""


class CorruptShardError(CacheError):
    """A shard is missing, truncated or fails its checksum."""
