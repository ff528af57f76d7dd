"""`distill verify`: check a cache's shards against its manifest without trusting either.

``check_shards`` is the cheap check a consumer runs before it relies on a cache (every shard's
size and checksum; no decoding); ``damaged_shards`` is what a rerun of stage one repairs. On a
sampled or hybrid (topk+sampled) cache ``verify_cache`` also decodes every shard by default and
checks the rows' own rules (``check_sampled_rows``; a hybrid row's drawn ids are none of its
exact top-K, which the distinct ids imply). ``verify_cache`` also checks the stored tokenizer
files the manifest lists (teacher_cache/tokenizer_files.py) against their checksums.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from distill.files import TEMP_MARK
from teacher_cache.errors import OTHER_OUT, REPAIR_HINT, CacheError, CorruptShardError
from teacher_cache.location import cache_location
from teacher_cache.manifest import load_manifest
from teacher_cache.store import SHARDS_DIR, decode_shard, get_store, read_shard, shard_checksum, shard_name
from teacher_cache.tokenizer_files import read_tokenizer_files


@dataclass
class VerifyReport:
    path: str
    cache_id: str
    status: str  # the manifest's status
    shards_expected: int
    shards_checked: int = 0
    bytes_checked: int = 0
    missing: list[str] = field(default_factory=list)  # shard names with no file
    bad: list[tuple[str, str]] = field(default_factory=list)  # (shard name, what is wrong), in shard order
    problems: list[str] = field(default_factory=list)  # manifest-level problems (status, totals)
    unexpected: list[str] = field(default_factory=list)  # files in shards/ the manifest does not list
    tokenizer_files_checked: int = 0  # stored tokenizer files the manifest lists (tokenizer_files.py)
    tokenizer_problems: list[str] = field(default_factory=list)  # "name: what is wrong" for those missing or damaged

    @property
    def ok(self) -> bool:
        return not (self.missing or self.bad or self.problems or self.tokenizer_problems)

    @property
    def first_bad(self) -> str | None:
        return self.bad[0][0] if self.bad else None

    @property
    def message(self) -> str:
        """One line: "ok ..." or everything wrong, the first bad shard named first."""
        if self.ok:
            files = (f", {self.tokenizer_files_checked} tokenizer files" if self.tokenizer_files_checked else "")
            extra = f"; {len(self.unexpected)} unlisted file(s) in shards/" if self.unexpected else ""
            return (f"{self.path}: cache {self.cache_id} ok: {self.shards_checked} shards, "
                    f"{self.bytes_checked:,} bytes{files} checked{extra}")
        parts = []
        if self.bad:
            name, why = self.bad[0]
            more = f" (and {len(self.bad) - 1} more bad)" if len(self.bad) > 1 else ""
            parts.append(f"first bad shard {name}: {why}{more}")
        if self.missing:
            parts.append(f"{len(self.missing)} missing shard(s): {', '.join(self.missing[:5])}"
                         + (" ..." if len(self.missing) > 5 else ""))
        parts.extend(self.problems)
        if self.tokenizer_problems:
            more = f" (and {len(self.tokenizer_problems) - 1} more)" if len(self.tokenizer_problems) > 1 else ""
            parts.append(f"stored tokenizer file {self.tokenizer_problems[0]}{more}")
        if self.status != "complete":
            hint = ""  # the status problem says how to finish the cache
        elif self.problems:
            hint = f"; the manifest does not match its shards: build the cache again into {OTHER_OUT}"
        elif self.missing or self.bad:
            hint = f"; {REPAIR_HINT}"
        else:
            hint = ""
        if self.tokenizer_problems:
            hint += (f"; restore the tokenizer files with `distill add-tokenizer {self.path} TEACHER_FOLDER` (the "
                     "teacher the cache was built from)")
        return f"{self.path}: cache {self.cache_id} FAILED: " + "; ".join(parts) + hint


def check_sampled_rows(ids: np.ndarray, counts: np.ndarray, samples: int) -> str | None:
    """What breaks a sampled shard's row rules, or None: counts sum to ``samples`` on every row,
    and a row's ids are distinct (padding ids too: the fused loss stores gradients at ids).
    ids: int [N, S]; counts: uint8 [N, S]."""
    sums = counts.sum(axis=1, dtype=np.int64)
    bad = np.flatnonzero(sums != samples)
    if bad.size:
        return f"row {bad[0]}'s sample counts sum to {sums[bad[0]]}, not samples={samples} ({bad.size} such rows)"
    ordered = np.sort(ids, axis=1)
    dup = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if dup.size:
        return f"row {dup[0]} holds an id twice ({dup.size} such rows); a row's ids (padding too) must be distinct"
    return None


def verify_cache(path: str | os.PathLike, deep: bool | None = None, tokenizer: bool = True) -> VerifyReport:
    """Check every shard's existence, size and checksum, and the manifest's totals.

    deep=True also decodes every shard and checks its sequence and token counts and, in a sampled
    cache, its rows (``check_sampled_rows``); slower. None: deep for a sampled cache only.
    tokenizer: also check the stored tokenizer files the manifest lists against their checksums
    (``check_shards`` and ``damaged_shards`` leave them out: they are about the shards). A
    manifest that cannot be read raises ``CacheError``; everything else is in the report.
    """
    path = cache_location(path)
    manifest = load_manifest(path)
    spec = manifest.spec
    deep = spec.targets.sampled if deep is None else deep
    store = get_store(spec.storage.format)
    shards_dir = path / SHARDS_DIR
    report = VerifyReport(path=str(path), cache_id=manifest.cache_id, status=manifest.status,
                          shards_expected=spec.num_shards)
    on_disk = sorted(p.name for p in shards_dir.iterdir()) if shards_dir.is_dir() else []
    expected_names = [shard_name(i, store) for i in range(spec.num_shards)]
    if manifest.status != "complete":
        present = set(on_disk)
        report.missing = [n for n in expected_names if n not in present]
        report.problems.append(f"status is {manifest.status!r} ({spec.num_shards - len(report.missing)} of "
                               f"{spec.num_shards} shards written): rerun `distill cache-teacher` to finish it")
        return report

    listed = [s.name for s in manifest.shards]
    if listed != expected_names:
        report.problems.append(f"manifest lists shards {_short(listed)}, expected {_short(expected_names)}")
    for total, expected, what in ((sum(s.sequences for s in manifest.shards), spec.data.sequences, "sequences"),
                                  (sum(s.tokens for s in manifest.shards), spec.data.tokens, "tokens")):
        if total != expected:
            report.problems.append(f"shards hold {total} {what}, the data section says {expected}")
    report.unexpected = [n for n in on_disk if n not in set(listed) or n.endswith(TEMP_MARK)]
    if tokenizer and spec.tokenizer.files:
        report.tokenizer_files_checked = len(spec.tokenizer.files)
        report.tokenizer_problems = read_tokenizer_files(path, spec.tokenizer.files)[1]

    codec = None
    if deep:
        from teacher_cache.codecs import get_codec
        from teacher_cache.reader import check_target_arrays

        codec = get_codec(spec.targets.value_codec)
    for info in manifest.shards:
        shard_path = shards_dir / info.name
        if not shard_path.exists():
            report.missing.append(info.name)
            continue
        checksum, nbytes = shard_checksum(shard_path)
        report.shards_checked += 1
        report.bytes_checked += nbytes
        if nbytes != info.bytes:
            report.bad.append((info.name, f"{nbytes} bytes on disk, manifest says {info.bytes} (truncated?)"))
        elif checksum != info.checksum:
            report.bad.append((info.name, "checksum differs from the manifest (damaged or modified)"))
        elif codec is not None:
            try:
                input_ids, offsets, targets = decode_shard(read_shard(store, shard_path, info.name), codec, info.name)
                check_target_arrays(targets, spec.targets, info.name)
            except CacheError as e:
                report.bad.append((info.name, str(e)))
                continue
            if (len(offsets) - 1, len(input_ids)) != (info.sequences, info.tokens):
                report.bad.append((info.name, f"holds {len(offsets) - 1} sequences / {len(input_ids)} tokens, "
                                              f"manifest says {info.sequences} / {info.tokens}"))
            elif spec.targets.sampled and (why := check_sampled_rows(targets.topk_ids, targets.sample_counts,
                                                                      spec.targets.samples)):
                report.bad.append((info.name, why))
    return report


def check_shards(path: str | os.PathLike) -> None:
    """Every shard of the complete cache at ``path`` exists with the size and checksum its manifest
    records. Raises ``CorruptShardError`` naming the first bad shard and how to repair it (an
    incomplete cache or a manifest that does not match its shards raises ``CacheError``).

    Reads every byte once but decodes nothing: cheap next to any use of the cache."""
    report = verify_cache(path, deep=False, tokenizer=False)
    if report.ok:
        return
    if report.status == "complete" and not report.problems:
        raise CorruptShardError(report.message)
    raise CacheError(report.message)


def damaged_shards(path: str | os.PathLike) -> list[int]:
    """Indices of the missing or damaged shards of the complete cache at ``path`` (empty when it is
    whole); CacheError when the cache is incomplete or its manifest does not match its shards."""
    report = verify_cache(path, deep=False, tokenizer=False)
    if report.ok:
        return []
    if report.status != "complete" or report.problems:
        raise CacheError(report.message)
    names = {*report.missing, *(name for name, _ in report.bad)}
    manifest = load_manifest(path)
    return [i for i, info in enumerate(manifest.shards) if info.name in names]


def _short(names: list[str]) -> str:
    return f"[{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}] ({len(names)})"
