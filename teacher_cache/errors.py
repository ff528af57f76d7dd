"""Errors of the cache format. Their base, `DistillUserError`, lives in `distill.errors`."""

from distill.errors import DistillUserError

# How a damaged shard is fixed: a rerun re-checks every shard and rebuilds exactly the bad ones.
REPAIR_HINT = ("rerun `distill cache-teacher` with the options that built the cache (its stage_one_config.json "
               "records them) to rebuild the damaged shards")
# Where a cache that cannot go into its folder goes instead: a CacheError has no surface to name the
# setting after (a ConfigError does: distill/configs.py), so it names both.
OTHER_OUT = "another folder for the cache (--out; in a recipe, [cache] out)"


class CacheError(DistillUserError):
    """A cache that cannot be read or written as asked."""


class CacheLockedError(CacheError):
    """Another writer holds the cache's LOCK."""


class CacheMismatchError(CacheError):
    """The cache directory holds another cache's data, or a cache that does not fit the reader."""


class CorruptShardError(CacheError):
    """A shard is missing, truncated or fails its checksum."""
