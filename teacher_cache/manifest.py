"""manifest.json of a teacher cache (format "distill-teacher-cache", version 1, 2 or 3).

Version 1 is a top-k cache; its targets section has no ``kind``. Version 2 is a cache whose
targets section names its ``kind`` ("sampled": RS-KD sampled targets, with ``samples``,
``proposal_temperature`` and ``seed``). Version 3 is a hybrid cache ("topk+sampled": the exact
``topk`` ids per position, then ``samples`` draws from outside them; ``k`` = topk + samples
slots). A top-k cache is still written as version 1 and a sampled one as version 2, byte for
byte as before (same ``cache_id``), so every distill that read them reads them; an older distill
refuses a newer version by its number, which it cannot read.

The manifest is the contract between stage one and stage two: readers check it before they
touch a shard. Loading is strict: an unknown format version, a missing or unknown key, or a value
out of range is a ``CacheError`` that says what was seen and what to do.

``cache_id`` hashes the identity fields only (what determines the shard contents), so a directory
is claimed by its identity and a rerun with the same arguments finds and resumes its own cache.
The tokenizer section's ``files`` (the teacher's tokenizer files stored in CACHE/tokenizer/, with
their checksums) is not identity: a cache that gains them keeps its ``cache_id``, and a manifest
without them (every cache written before they were stored) reads as before.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from teacher_cache.errors import CacheError

FORMAT_NAME = "distill-teacher-cache"
FORMAT_VERSION = 1  # of a top-k cache
SAMPLED_FORMAT_VERSION = 2  # of a cache whose targets name their kind
HYBRID_FORMAT_VERSION = 3  # of a top-k + sampled cache (targets.topk)
FORMAT_VERSIONS = (FORMAT_VERSION, SAMPLED_FORMAT_VERSION, HYBRID_FORMAT_VERSION)
TARGET_KINDS = ("topk", "sampled", "topk+sampled")
_VERSION_OF_KIND = {"topk": FORMAT_VERSION, "sampled": SAMPLED_FORMAT_VERSION, "topk+sampled": HYBRID_FORMAT_VERSION}
# targets fields a top-k cache leaves out of its manifest and identity (version 1 has none of them)
_SAMPLED_FIELDS = ("kind", "samples", "proposal_temperature", "seed")
# the one a sampled cache leaves out too (version 2 has no exact head)
_HYBRID_FIELDS = ("topk",)
MANIFEST_NAME = "manifest.json"
LOCK_NAME = "LOCK"  # the writers' lock file beside it (teacher_cache/writer.py)
STORAGE_FORMATS = ("zarr", "parquet")
STATUSES = ("incomplete", "complete")
_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise CacheError(message)


def _nonempty_str(value: Any, name: str) -> None:
    _require(isinstance(value, str) and value != "", f"{name} must be a non-empty string, got {value!r}")


def _int_at_least(value: Any, low: int, name: str) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    _require(ok, f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class TeacherInfo:
    path: str  # where the teacher was loaded from (informative; not part of the identity)
    weights_hash: str  # hash of the weight files; the teacher's identity
    backend: str  # "hf" | "vllm"
    dtype: str  # compute dtype of the teacher, e.g. "bfloat16"

    def __post_init__(self) -> None:
        for name in ("path", "weights_hash", "backend", "dtype"):
            _nonempty_str(getattr(self, name), f"teacher.{name}")


@dataclass(frozen=True)
class TokenizerInfo:
    hash: str  # hash of the token-to-id map and special tokens
    vocab_size: int  # number of token ids the tokenizer can produce
    special_ids: dict = field(default_factory=dict)  # {"bos": int | None, "eos": ..., ...}
    # the tokenizer's files stored in CACHE/tokenizer/, {name: "sha256:<hex>"} (tokenizer_files.py);
    # empty (and left out of the JSON, so older caches keep their bytes) when none are stored
    files: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _nonempty_str(self.hash, "tokenizer.hash")
        _int_at_least(self.vocab_size, 1, "tokenizer.vocab_size")
        _require(isinstance(self.special_ids, dict),
                 f"tokenizer.special_ids must be a mapping, got {self.special_ids!r}")
        for name, value in self.special_ids.items():
            if value is not None:
                _int_at_least(value, 0, f"tokenizer.special_ids[{name!r}]")
        _require(isinstance(self.files, dict), f"tokenizer.files must be a mapping, got {self.files!r}")
        for name, checksum in self.files.items():
            ok = isinstance(name, str) and "\\" not in name and all(
                part not in ("", ".", "..") for part in name.split("/"))
            _require(ok, f"tokenizer.files names must be relative file names inside tokenizer/, got {name!r}")
            _require(isinstance(checksum, str) and _SHA256.fullmatch(checksum) is not None,
                     f"tokenizer.files[{name!r}] must be 'sha256:' and 64 hex digits, got {checksum!r}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.files:
            del d["files"]
        return d


@dataclass(frozen=True)
class DataInfo:
    source: str  # human description of the corpus (paths, dataset name)
    fingerprint: str  # hash of the packed token ids; the corpus' identity
    sequences: int  # number of packed sequences in the cache
    tokens: int  # number of positions (rows) in the cache
    seq_len: int  # packing length; every sequence has at most this many tokens
    # Text a policy wrote (`distill generate`): {"corpus": its folder, "policy": {"path", "run", "step",
    # "weights_hash"}, "sampler": its settings}; each record one sequence, whose shards hold the
    # per-row loss_mask and sampler_logprob (teacher_cache/store.py). None: any other corpus.
    generated: dict | None = None

    def __post_init__(self) -> None:
        _require(self.generated is None or isinstance(self.generated, dict),
                 f"data.generated must be a mapping or absent, got {type(self.generated).__name__}")
        _nonempty_str(self.source, "data.source")
        _nonempty_str(self.fingerprint, "data.fingerprint")
        _int_at_least(self.sequences, 1, "data.sequences")
        _int_at_least(self.seq_len, 1, "data.seq_len")
        _int_at_least(self.tokens, self.sequences, "data.tokens")
        _require(
            self.tokens <= self.sequences * self.seq_len,
            f"data.tokens must be <= sequences * seq_len = {self.sequences * self.seq_len}, got {self.tokens}",
        )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.generated is None:  # every other cache's manifest as before
            del d["generated"]
        return d


def _positive_float(value: Any, name: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    _require(ok and math.isfinite(value) and value > 0, f"{name} must be a finite number > 0, got {value!r}")
    return float(value)  # 1 and 1.0 must hash to the same cache_id


@dataclass(frozen=True)
class TargetsInfo:
    k: int  # entries stored per position (top-k; sampled: the slots, = samples; topk+sampled: topk + samples)
    value_codec: str  # how top-k log-probs are stored: fp32 | bf16 | fp16 | a quantised codec
    temperature: float  # stored log-probs are log_softmax(logits / temperature)
    kind: str = "topk"  # "topk" | "sampled" (RS-KD: ids drawn from the proposal, with counts) | "topk+sampled"
    samples: int | None = None  # sampled: ids drawn per position (with replacement)
    proposal_temperature: float | None = None  # sampled: drawn from softmax(logits / this)
    seed: int | None = None  # sampled: seed of the draws (teacher_cache.targets.Sampling)
    topk: int | None = None  # topk+sampled: exact top ids per position, before the draws from outside them

    def __post_init__(self) -> None:
        _int_at_least(self.k, 1, "targets.k")
        _nonempty_str(self.value_codec, "targets.value_codec")
        object.__setattr__(self, "temperature", _positive_float(self.temperature, "targets.temperature"))
        _require(self.kind in TARGET_KINDS, f"targets.kind must be one of {', '.join(TARGET_KINDS)}, "
                                            f"got {self.kind!r}")
        if self.kind == "topk":
            extra = [name for name in (*_SAMPLED_FIELDS[1:], *_HYBRID_FIELDS) if getattr(self, name) is not None]
            _require(not extra, f"a top-k cache has no targets.{', targets.'.join(extra)}")
            return
        _int_at_least(self.samples, 1, "targets.samples")
        _require(self.samples <= 255, f"targets.samples must be at most 255 (uint8 counts), got {self.samples}")
        if self.kind == "sampled":
            _require(self.topk is None, "a sampled cache has no targets.topk (a topk+sampled cache has)")
        else:
            _int_at_least(self.topk, 1, "targets.topk")
        _require(self.k == self.head + self.samples,
                 f"targets.k must equal targets.{'topk + targets.' if self.hybrid else ''}samples in a {self.kind} "
                 f"cache, got k={self.k}, samples={self.samples}" + (f", topk={self.topk}" if self.hybrid else ""))
        object.__setattr__(self, "proposal_temperature",
                           _positive_float(self.proposal_temperature, "targets.proposal_temperature"))
        _int_at_least(self.seed, 0, "targets.seed")

    @property
    def sampled(self) -> bool:
        """Whether the rows hold drawn ids with counts (a sampled or a topk+sampled cache)."""
        return self.kind != "topk"

    @property
    def hybrid(self) -> bool:
        return self.kind == "topk+sampled"

    @property
    def head(self) -> int:
        """Exact top ids at the front of every row before the drawn ones (0 unless hybrid)."""
        return self.topk if self.hybrid else 0

    @property
    def proposal_is_teacher(self) -> bool:
        """Whether the ids were drawn from the stored distribution itself (then no proposal log-probs are stored)."""
        return self.proposal_temperature == self.temperature

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {key: value for key, value in d.items() if key in _targets_keys(self.kind)}


def _targets_keys(kind: str) -> tuple[str, ...]:
    """The targets keys a cache of ``kind`` writes (and hashes into its identity)."""
    keys = ("k", "value_codec", "temperature")
    if kind != "topk":
        keys += _SAMPLED_FIELDS
    if kind == "topk+sampled":
        keys += _HYBRID_FIELDS
    return keys


@dataclass(frozen=True)
class StorageInfo:
    format: str  # "zarr" | "parquet"
    shard_size: int  # sequences per shard (the last shard may hold fewer)
    codecs: dict = field(default_factory=dict)  # lossless compression used, as the store describes it

    def __post_init__(self) -> None:
        _require(self.format in STORAGE_FORMATS,
                 f"storage.format must be one of {', '.join(STORAGE_FORMATS)}, got {self.format!r}")
        _int_at_least(self.shard_size, 1, "storage.shard_size")
        _require(isinstance(self.codecs, dict), f"storage.codecs must be a mapping, got {self.codecs!r}")


@dataclass(frozen=True)
class ShardInfo:
    name: str  # file or directory name under shards/, e.g. "00000.zarr"
    sequences: int
    tokens: int
    checksum: str  # "sha256:<hex>" over the shard's files (see store.shard_checksum)
    bytes: int  # bytes on disk over the shard's files

    def __post_init__(self) -> None:
        _nonempty_str(self.name, "shard name")
        _require("/" not in self.name and not self.name.startswith("."),
                 f"shard name must be a plain name, got {self.name!r}")
        _int_at_least(self.sequences, 1, f"shard {self.name} sequences")
        _int_at_least(self.tokens, self.sequences, f"shard {self.name} tokens")
        _require(isinstance(self.checksum, str) and self.checksum.startswith("sha256:"),
                 f"shard {self.name} checksum must start with 'sha256:', got {self.checksum!r}")
        _int_at_least(self.bytes, 0, f"shard {self.name} bytes")


_SECTIONS = {"teacher": TeacherInfo, "tokenizer": TokenizerInfo, "data": DataInfo, "targets": TargetsInfo,
             "storage": StorageInfo}

# The fields that determine shard contents, as section -> keys. Paths, descriptions, totals that
# follow from the fingerprint, compression settings and shard bookkeeping are left out. A top-k
# cache's identity leaves out the sampled-only targets fields (so its cache_id is as before).
IDENTITY_FIELDS = {
    "teacher": ("weights_hash", "backend", "dtype"),
    "tokenizer": ("hash",),
    "data": ("fingerprint", "seq_len"),
    "targets": ("k", "value_codec", "temperature", *_SAMPLED_FIELDS, *_HYBRID_FIELDS),
    "storage": ("format", "shard_size"),
}


def _section_from_dict(cls, value: Any, where: str):
    _require(isinstance(value, dict), f"{where} must be a mapping, got {type(value).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown = sorted(set(value) - names)
    _require(not unknown, f"{where} has unknown key(s) {unknown}; allowed: {sorted(names)}")
    missing = sorted(required - set(value))
    _require(not missing, f"{where} is missing key(s) {missing}")
    return cls(**value)


@dataclass(frozen=True)
class CacheSpec:
    """Everything a writer is told up front: the manifest without shards, times and status."""

    teacher: TeacherInfo
    tokenizer: TokenizerInfo
    data: DataInfo
    targets: TargetsInfo
    storage: StorageInfo

    @staticmethod
    def from_dict(d: dict) -> "CacheSpec":
        """Strict: sections are {"teacher", "tokenizer", "data", "targets", "storage"} with their keys."""
        parts = {name: _section_from_dict(cls, d.get(name), name) for name, cls in _SECTIONS.items()}
        unknown = sorted(set(d) - set(_SECTIONS))
        _require(not unknown, f"cache spec has unknown section(s) {unknown}; allowed: {sorted(_SECTIONS)}")
        return CacheSpec(**parts)

    @property
    def format_version(self) -> int:
        return _VERSION_OF_KIND[self.targets.kind]

    def identity(self) -> dict:
        ident: dict[str, Any] = {"format": FORMAT_NAME, "version": self.format_version}
        for section, keys in IDENTITY_FIELDS.items():
            if section == "targets":
                keys = tuple(key for key in keys if key in _targets_keys(self.targets.kind))
            ident[section] = {key: getattr(getattr(self, section), key) for key in keys}
        return ident

    @property
    def cache_id(self) -> str:
        canonical = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def num_shards(self) -> int:
        return -(-self.data.sequences // self.storage.shard_size)

    def shard_sequences(self, index: int) -> int:
        """How many sequences shard ``index`` holds (the last shard may be short)."""
        start = index * self.storage.shard_size
        return min(self.storage.shard_size, self.data.sequences - start)


def identity_diff(a: CacheSpec, b: CacheSpec) -> list[str]:
    """Identity fields that differ, as "section.key: a_value vs b_value"."""
    out = []
    for section, keys in IDENTITY_FIELDS.items():
        for key in keys:
            va, vb = getattr(getattr(a, section), key), getattr(getattr(b, section), key)
            if va != vb:
                out.append(f"{section}.{key}: {va!r} vs {vb!r}")
    return out


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("distill")
    except PackageNotFoundError:
        return "unknown (distill not installed as a package)"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Manifest:
    spec: CacheSpec
    status: str  # "incomplete" until every shard is written, then "complete"
    shards: tuple[ShardInfo, ...] = ()
    tool_version: str = field(default_factory=tool_version)
    created: str = field(default_factory=utc_now)  # UTC, when the cache directory was claimed

    def __post_init__(self) -> None:
        _require(self.status in STATUSES, f"manifest status must be one of {', '.join(STATUSES)}, got {self.status!r}")
        object.__setattr__(self, "shards", tuple(self.shards))

    @property
    def cache_id(self) -> str:
        return self.spec.cache_id

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"format": FORMAT_NAME, "version": self.spec.format_version, "cache_id": self.cache_id,
                             "status": self.status}
        for name in _SECTIONS:
            section = getattr(self.spec, name)
            d[name] = section.to_dict() if name in ("targets", "tokenizer", "data") else dataclasses.asdict(section)
        d["shards"] = [dataclasses.asdict(s) for s in self.shards]
        d["tool_version"] = self.tool_version
        d["created"] = self.created
        return d

    @staticmethod
    def from_dict(d: dict) -> "Manifest":
        _require(isinstance(d, dict), f"manifest must be a JSON object, got {type(d).__name__}")
        _require(d.get("format") == FORMAT_NAME,
                 f"not a distill teacher cache manifest: format is {d.get('format')!r}, expected {FORMAT_NAME!r}")
        _require(d.get("version") in FORMAT_VERSIONS,
                 f"cache format version {d.get('version')!r} is not supported; this distill ({tool_version()}) "
                 f"reads versions {', '.join(map(str, FORMAT_VERSIONS))}: upgrade distill or rebuild the cache")
        top = {"format", "version", "cache_id", "status", "shards", "tool_version", "created", *_SECTIONS}
        unknown, missing = sorted(set(d) - top), sorted(top - set(d))
        _require(not unknown, f"manifest has unknown key(s) {unknown}; written by a newer distill?")
        _require(not missing, f"manifest is missing key(s) {missing}")
        spec = CacheSpec.from_dict({name: d[name] for name in _SECTIONS})
        if d["version"] != FORMAT_VERSION:
            _require(isinstance(d["targets"], dict) and "kind" in d["targets"],
                     f"a version {d['version']} manifest names its targets.kind; this one does not")
        _require(d["version"] == spec.format_version,
                 f"manifest version {d['version']} does not match its {spec.targets.kind} targets (version "
                 f"{spec.format_version}); the manifest was edited by hand: restore it or rebuild the cache")
        _require(isinstance(d["shards"], list), f"manifest shards must be a list, got {type(d['shards']).__name__}")
        shards = tuple(_section_from_dict(ShardInfo, s, f"shards[{i}]") for i, s in enumerate(d["shards"]))
        m = Manifest(spec=spec, status=d["status"], shards=shards, tool_version=str(d["tool_version"]),
                     created=str(d["created"]))
        _require(d["cache_id"] == m.cache_id,
                 f"manifest cache_id {d['cache_id']!r} does not match its identity fields ({m.cache_id!r}); "
                 "the manifest was edited by hand: restore it or rebuild the cache")
        return m


def manifest_path(cache_dir: str | os.PathLike) -> Path:
    """CACHE/manifest.json (a ``location.RemotePath`` when the cache is at a URL)."""
    from teacher_cache.location import cache_location

    return cache_location(cache_dir) / MANIFEST_NAME


def load_manifest(cache_dir: str | os.PathLike) -> Manifest:
    """Read and validate CACHE/manifest.json; every problem is a one-line ``CacheError``."""
    path = manifest_path(cache_dir)
    if not path.is_file():
        if not path.parent.exists():
            raise CacheError(f"{cache_dir} does not exist; check the path, or build a cache there with "
                             "`distill cache-teacher`")
        if not path.parent.is_dir():
            raise CacheError(f"{cache_dir} is a file, not a cache folder; give the folder `distill cache-teacher` "
                             "wrote")
        raise CacheError(f"{cache_dir} holds no {MANIFEST_NAME}: not a teacher cache; build one with "
                         "`distill cache-teacher` or check the path")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CacheError(f"{path} is not valid JSON ({e}); the cache is damaged: rebuild it") from e
    try:
        return Manifest.from_dict(d)
    except CacheError as e:
        raise CacheError(f"{path}: {e}") from e
