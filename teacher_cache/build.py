"""Stage one: score packed sequences with a teacher backend and write a cache.

Teacher compute runs on the calling thread; shards are encoded, compressed and written on
background threads, so a GPU teacher never waits for the disk unless the writers fall behind
(the run summary reports both times so that shows). Rows stream: each block of rows the teacher
produces (a batch of short sequences, or one prefill chunk of a long one) is handed to the
writer thread of its shard at once, and the rows handed over but not yet taken are bounded, so
host memory stays bounded however long a sequence is.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm.auto import tqdm

from distill.configs import ConfigError, check_types, option, require
from distill.errors import DistillUserError
from teacher_cache.backends.base import TeacherBackend
from teacher_cache.codecs import codec_names
from teacher_cache.errors import CacheError
from teacher_cache.location import RemotePath, cache_location
from teacher_cache.manifest import IDENTITY_FIELDS, CacheSpec, identity_diff, load_manifest, manifest_path
from teacher_cache.store import get_store, shard_name
from teacher_cache.targets import Sampling, TeacherTargets
from teacher_cache.tokenizer_files import save_tokenizer_files
from teacher_cache.workers import Workers, shard_owner
from teacher_cache.writer import CacheLock, CacheWriter

log = logging.getLogger(__name__)

# Rows scored but not yet taken by a writer thread. Several default shards (64 x 1024 rows at
# k = 100) fit, so a fast teacher hands whole shards over without waiting, as before rows
# streamed; a long sequence's rows wait here instead of piling up in host memory.
_HANDOFF_BYTES = 1 << 30


@dataclass
class CacheConfig:
    """How stage one writes its cache."""

    # a URL is resolved by teacher_cache/location.py
    out: str | Path | RemotePath = option(help=(
        "Cache directory to write (resumed if interrupted, repaired if damaged), or an fsspec URL "
        "(s3://bucket/prefix, gs://..., file://...)."), flags=("--out", "-o"))
    targets: Literal["topk", "sampled", "topk+sampled"] = option("topk", (
        "topk: the teacher's k likeliest ids per position; sampled: RS-KD, --samples ids drawn per position from "
        "the teacher (unique ids with counts: an unbiased estimate of the full-vocabulary KL; hf backend only); "
        "topk+sampled: the exact top --k, then --samples ids drawn from the teacher outside them (hf backend "
        "only)."))
    k: int = option(100, "Top-k entries cached per position (--targets topk; topk+sampled: the exact head before "
                         "the draws).", flags=("-k", "--k"))
    # 12: the RS-KD paper's choice, about a dozen
    samples: int = option(12, "Ids drawn per position, with replacement (--targets sampled or topk+sampled; at "
                              "most 255).")
    # None: the stored counts alone weight the ids (no proposal log-probs stored)
    proposal_temperature: float | None = option(None, (
        "Draw from softmax(logits / this) instead of the cached teacher (--targets sampled; topk+sampled: "
        "restricted to the ids outside the top --k and renormalised); the cache then also stores the proposal's "
        "log-probs, for importance weights. Default: the cache --temperature."))
    seed: int = option(0, (
        "Seed of the draws (--targets sampled or topk+sampled); a sequence's draws depend only on it and the "
        "sequence's index, not on batching, shards or workers."))
    # see teacher_cache/codecs.py
    value_codec: str = option("sqrt8", "Value codec: fp32, bf16, fp16 or sqrt8 (compressed).", flags=("--codec",))
    # parquet is the default because it writes cheaper at the same size
    # (tests/benchmarks/notes/capture.md, "Stage one end to end on the H200")
    storage: Literal["parquet", "zarr"] = option("parquet", "parquet or zarr (Zarr v3).")
    shard_size: int = option(64, "Sequences per shard.")
    batch_size: int = option(8, "Sequences per teacher call.")
    temperature: float = option(1.0, "Cache temperature: stored log-probs are log_softmax(logits / T).")
    writer_threads: int = 0  # shards encoded and written in parallel; 0 = min(8, CPU count)
    # see teacher_cache/workers.py
    num_workers: int = option(1, (
        "A job array of this many workers (Slurm array or any scheduler): this process writes only its shards "
        "(shard i belongs to worker i mod W) and no manifest; `distill cache-merge` writes it. Under torchrun the "
        "ranks are the workers: leave it at 1."))
    worker_index: int = option(0, "This worker's index in [0, --num-workers) (e.g. $SLURM_ARRAY_TASK_ID).")
    # see teacher_cache/ray_executor.py
    executor: Literal["local", "ray"] = option("local", (
        "local (this process scores every shard) or ray (one Ray task per shard on a Ray cluster; a task whose "
        "worker dies is retried; needs the `ray` extra)."))
    ray_address: str | None = option(None, (
        "The Ray cluster (--executor ray), e.g. 10.0.0.1:6379; default: RAY_ADDRESS, else a cluster started on "
        "this machine by `ray start`, else a new local one."))

    def __post_init__(self) -> None:
        check_types(self)
        self.out = cache_location(self.out)
        require("k", self.k, self.k >= 1, "an integer >= 1")
        require("samples", self.samples, 1 <= self.samples <= 255, "an integer in [1, 255] (counts are uint8)")
        require("proposal_temperature", self.proposal_temperature, self.proposal_temperature is None or (
            math.isfinite(self.proposal_temperature) and self.proposal_temperature > 0), "a finite number > 0")
        require("seed", self.seed, self.seed >= 0, "an integer >= 0")
        require("value_codec", self.value_codec, self.value_codec in codec_names(),
                f"one of {', '.join(codec_names())}")
        require("shard_size", self.shard_size, self.shard_size >= 1, "an integer >= 1")
        require("batch_size", self.batch_size, self.batch_size >= 1, "an integer >= 1")
        require("temperature", self.temperature, math.isfinite(self.temperature) and self.temperature > 0,
                "a finite number > 0")
        require("writer_threads", self.writer_threads, self.writer_threads >= 0, "an integer >= 0 (0 = automatic)")
        require("num_workers", self.num_workers, self.num_workers >= 1, "an integer >= 1")
        require("worker_index", self.worker_index, 0 <= self.worker_index < self.num_workers,
                f"an integer in [0, --num-workers={self.num_workers})")
        if self.executor == "ray" and self.num_workers > 1:
            raise ConfigError("executor", f"is 'ray' with --num-workers {self.num_workers} (a job array): Ray "
                                          "schedules the shards itself; drop --num-workers and --worker-index")
        require("ray_address", self.ray_address, self.ray_address is None or self.executor == "ray",
                "unset unless --executor ray")

    @property
    def slots(self) -> int:
        """Entries stored per position: k, the samples of a sampled cache, or k + samples (hybrid)."""
        return {"topk": self.k, "sampled": self.samples, "topk+sampled": self.k + self.samples}[self.targets]

    @property
    def sampling(self) -> Sampling | None:
        if self.targets == "topk":
            return None
        proposal = self.temperature if self.proposal_temperature is None else self.proposal_temperature
        return Sampling(samples=self.samples, proposal_temperature=float(proposal), seed=self.seed,
                        topk=self.k if self.targets == "topk+sampled" else 0)


def check_k_fits(k: int, vocab_size: int | None, name: str = "k") -> None:
    """`k` (or `samples`, named by `name`) against the teacher's vocabulary, before any work."""
    if vocab_size is not None and k > vocab_size:
        raise ConfigError(name, f"must be in [1, vocab_size={vocab_size}] (the teacher's vocabulary), got {k}")


def check_targets_fit(config: CacheConfig, vocab_size: int | None) -> None:
    """A cache's slots per position against the teacher's vocabulary, before any work (ConfigError
    naming the option); a hybrid row's k + samples ids are distinct, so they must fit together."""
    if config.targets != "topk+sampled":
        check_k_fits(config.slots, vocab_size, "samples" if config.targets == "sampled" else "k")
    elif vocab_size is not None and config.slots > vocab_size:
        raise ConfigError("samples", f"plus --k={config.k} must be at most vocab_size={vocab_size} with --targets "
                                     f"topk+sampled (a row's ids are distinct), got {config.samples}; lower "
                                     "--samples or --k")


def check_backend_can_sample(backend: TeacherBackend | str, config: CacheConfig) -> None:
    """A sampled cache needs a backend that sees the teacher's whole distribution (ConfigError naming `backend`)."""
    name = backend if isinstance(backend, str) else backend.name
    can = name == "hf" if isinstance(backend, str) else getattr(backend, "can_sample", False)
    if config.targets != "topk" and not can:
        raise ConfigError("backend", f"must be hf with --targets {config.targets} (vLLM returns only the top-k prompt "
                                     f"log-probs, not the whole distribution to sample from), got {name!r}")


@dataclass
class BuildReport:
    """What a build did: the manifest path and where the time went."""

    cache_dir: Path
    cache_id: str
    already_complete: bool = False
    repaired_shards: list[str] = field(default_factory=list)  # damaged shards of a complete cache, rebuilt
    resumed_shards: int = 0
    written_shards: int = 0
    tokens_scored: int = 0
    teacher_seconds: float = 0.0  # time inside backend.score
    writer_seconds: float = 0.0  # summed over writer threads
    writer_wait_seconds: float = 0.0  # time the teacher thread waited for writers to catch up
    wall_seconds: float = 0.0
    worker: tuple[int, int] | None = None  # (index, count) in a multi-process build; None: one process
    finalized: bool = False  # this process wrote the complete manifest (a job-array worker never does)
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_scored / self.wall_seconds if self.wall_seconds else 0.0


def build_cache(
    sequences: list[np.ndarray],
    backend: TeacherBackend,
    config: CacheConfig,
    *,
    tokenizer: dict,
    data: dict,
    progress: bool = True,
    lock: CacheLock | None = None,
    workers: Workers | None = None,
    teacher_tokenizer=None,
    rows_of: dict[str, list[np.ndarray]] | None = None,
) -> BuildReport:
    """Score ``sequences`` (int32 token ids each) and write them as a cache at ``config.out``.

    tokenizer: ``identity.tokenizer_info`` of the teacher's tokenizer. data: {"source",
    "fingerprint", "seq_len"} of the packed corpus. lock: a ``writer.CacheLock`` the caller already
    holds on ``config.out`` (taken over and released; shared when ``workers`` has several), or
    None. workers: this process's part of a multi-process build (``teacher_cache.workers``); None
    is the one process. Re-running with the same arguments after an interruption resumes: finished
    shards are kept and only the missing ones are scored. Re-running on a complete cache checks
    every shard's size and checksum and rebuilds exactly the damaged ones (the one process or
    torchrun's rank 0 does; a job-array worker leaves a complete cache alone). teacher_tokenizer:
    the teacher's HF tokenizer, whose files worker 0 stores in the cache unless its manifest lists
    them already (teacher_cache/tokenizer_files.py); None stores none. rows_of: text a policy
    wrote (``data["generated"]`` set): its per-row arrays, one [L_i] array per sequence each
    (teacher_cache/store.py ``ROW_ARRAYS``).
    """
    if not sequences:
        raise DistillUserError("the corpus produced no sequences; give more text or a shorter --seq-len")
    check_targets_fit(config, backend.vocab_size)
    check_backend_can_sample(backend, config)
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    if lengths.min() < 2:
        raise DistillUserError(f"every sequence needs at least 2 tokens, got one of {lengths.min()}")
    workers = workers or Workers()
    identity = cache_identity(backend.describe(), config, tokenizer=tokenizer, data=data, lengths=lengths)
    start = time.perf_counter()
    num_shards = -(-len(sequences) // config.shard_size)
    mine = workers.shards(num_shards)
    writer = None
    try:
        collective = workers.collective
        if workers.leader:  # claims (and repairs) while the other ranks wait at the broadcast
            writer = _open_writer(config, identity, lock, None)
            report = _claim_report(writer, config, repair=True)
        if collective is not None and not workers.single:
            complete = collective.broadcast(report.already_complete if workers.leader else None)
            if complete and not workers.leader:
                return BuildReport(cache_dir=config.out, cache_id=CacheSpec.from_dict(
                    {**identity, "storage": {**identity["storage"], "codecs": {}}}).cache_id, already_complete=True)
        if writer is None:
            writer = _open_writer(config, identity, lock, mine)
            report = _claim_report(writer, config, repair=False)
        report.worker = None if workers.single else (workers.worker_index, workers.num_workers)
        if report.already_complete:
            return report
        if teacher_tokenizer is not None and workers.worker_index == 0 and not writer.spec.tokenizer.files:
            writer.set_tokenizer_files(save_tokenizer_files(teacher_tokenizer, writer.path)["files"])
        done = writer.done_shards()
        todo = [i for i in mine if i not in done]
        report.resumed_shards = len(mine) - len(todo)
        if report.resumed_shards and not report.repaired_shards:
            log.info("resuming %s: %d of this worker's %d shards already written, %d to go", config.out,
                     report.resumed_shards, len(mine), len(todo))
        if hasattr(backend, "write_shards"):  # the shards are written elsewhere (ray_executor.RayTeacher)
            if rows_of:
                raise DistillUserError("--executor ray cannot score generated text yet; use --executor local")
            backend.write_shards(sequences, lengths, todo, config, writer, report, progress)
        else:
            score_and_write(sequences, lengths, todo, backend, config, writer, report, progress, rows_of)
        if collective is not None:
            if workers.single:
                writer.finalize()
            else:
                _finalize_together(writer, collective, workers.leader)
            report.finalized = workers.leader
    finally:
        if writer is not None:
            writer.close()
        elif lock is not None:
            lock.release()
    report.wall_seconds = time.perf_counter() - start
    return report


def _open_writer(config: CacheConfig, identity: dict, lock, owned: list[int] | None) -> CacheWriter:
    return CacheWriter(config.out, identity, lock=lock, owned_shards=owned)


def _claim_report(writer, config: CacheConfig, repair: bool) -> BuildReport:
    """The report of a writer just opened; a complete cache is repaired (``repair``) or left alone."""
    report = BuildReport(cache_dir=config.out, cache_id=writer.cache_id)
    if not writer.is_complete:
        return report
    damaged = writer.damaged_shards() if repair else []
    if not damaged:
        report.already_complete = True
        log.info("cache %s (%s) is already complete; nothing to do", config.out, writer.cache_id)
        return report
    report.repaired_shards = [shard_name(i, get_store(config.storage)) for i in damaged]
    log.warning("cache %s (%s) has %d damaged or missing shard(s) (%s); rebuilding them", config.out,
                writer.cache_id, len(damaged), ", ".join(report.repaired_shards[:5]))
    writer.repair(damaged)
    return report


def _finalize_together(writer, collective, leader: bool) -> None:
    """Every rank's shard records to rank 0, which writes the manifest; the others wait for it."""
    gathered = collective.gather(writer.written)
    if leader:
        for infos in gathered:
            writer.record_shards(infos)
        writer.finalize()
    collective.barrier()


def merge_cache(path: Path, num_workers: int | None = None) -> tuple[str, bool]:
    """`distill cache-merge`: write the complete manifest of a cache whose shards the workers of a
    job array wrote, once every shard is there. Every shard is read once to record its size and
    checksum. Returns (cache_id, already_complete). num_workers: the array's --num-workers, so a
    missing shard's message names the worker that owns it."""
    if num_workers is not None:
        require("num_workers", num_workers, num_workers >= 1, "an integer >= 1 (the job array's --num-workers)")
    manifest = load_manifest(path)
    if manifest.status == "complete":
        return manifest.cache_id, True
    with CacheWriter(path, manifest.spec) as writer:  # the lock, exclusively: refused while workers write
        missing = sorted(set(range(writer.num_shards)) - writer.done_shards())
        if missing:
            store = get_store(manifest.spec.storage.format)
            shown = ", ".join(shard_name(i, store) for i in missing[:8]) + (" ..." if len(missing) > 8 else "")
            if num_workers is None:
                owners = "pass --num-workers W (the array's) to name the workers that own them"
            else:
                owners = "owned by --worker-index " + ", ".join(
                    str(w) for w in sorted({shard_owner(i, num_workers) for i in missing}))
                owners += f" of --num-workers {num_workers}: rerun those workers"
            raise CacheError(f"cannot merge {path}: {len(missing)} of {writer.num_shards} shards not written "
                             f"({shown}); {owners}, or run `distill cache-teacher` once without --num-workers to "
                             "score them here")
        writer.finalize()
    return manifest.cache_id, False


def cache_identity(teacher: dict, config: CacheConfig, *, tokenizer: dict, data: dict, lengths) -> dict:
    """The cache's identity (the manifest's spec before storage codecs are filled in).

    teacher: a backend's ``describe()``, or the same dict built without loading the model.
    """
    return {
        "teacher": teacher,
        "tokenizer": tokenizer,
        "data": {**data, "sequences": len(lengths), "tokens": int(np.sum(lengths))},
        **_settings_identity(config),
    }


def _settings_identity(config: CacheConfig) -> dict:
    targets = {"k": config.slots, "value_codec": config.value_codec, "temperature": float(config.temperature),
               "kind": config.targets}
    if (sampling := config.sampling) is not None:
        if sampling.topk:
            targets["topk"] = sampling.topk
        targets |= {"samples": sampling.samples, "proposal_temperature": sampling.proposal_temperature,
                    "seed": sampling.seed}
    return {"targets": targets, "storage": {"format": config.storage, "shard_size": config.shard_size}}


def other_cache_diff(existing, teacher: dict, config: CacheConfig, *, tokenizer: dict, seq_len: int) -> list[str]:
    """How the cache ``existing`` (a ``CacheSpec``) differs from the one asked for, in every
    identity field but the data fingerprint, which is known only once the corpus is tokenised: so
    an --out holding another cache is refused before that work. Entries read "section.key: cache
    value vs asked value"; empty when they all agree."""
    asked = {"teacher": teacher, "tokenizer": tokenizer, "data": {"seq_len": seq_len}, **_settings_identity(config)}
    diff = []
    for section, keys in IDENTITY_FIELDS.items():
        for key in keys:
            if key in asked[section] and getattr(getattr(existing, section), key) != asked[section][key]:
                diff.append(f"{section}.{key}: {getattr(getattr(existing, section), key)!r} vs {asked[section][key]!r}")
    return diff


def complete_cache_id(out: Path, identity: dict) -> str | None:
    """The cache id if ``out`` already holds this cache, complete; else None. Reads only the manifest.

    Lets a caller skip loading a teacher whose cache exists (``distill run`` reusing a cache).
    """
    if not manifest_path(out).exists():
        return None
    existing = load_manifest(out)
    asked = CacheSpec.from_dict({**identity, "storage": {**identity["storage"], "codecs": {}}})
    if existing.status != "complete" or identity_diff(existing.spec, asked):
        return None
    return existing.cache_id


def score_and_write(sequences: list[np.ndarray], lengths: np.ndarray, todo: list[int], backend: TeacherBackend,
                    config: CacheConfig, writer: CacheWriter, report: BuildReport, progress: bool,
                    rows_of: dict[str, list[np.ndarray]] | None = None) -> None:
    """Score the shards ``todo`` with ``backend`` and write each through ``writer`` (an atomic
    file with its checksum; ``writer.written`` then holds its ShardInfo), adding the tokens scored
    and the teacher's and writers' time to ``report``.

    sequences / lengths (int64 [num_sequences]): the whole cache's, indexed by position in the
    cache; only the entries of the shards in ``todo`` are read. The local build and each Ray
    task (``teacher_cache.ray_executor``, one shard) write shards through this one function, so a
    shard's bytes do not depend on where it was scored. rows_of: as ``build_cache``'s.
    """
    shard_size = config.shard_size
    # Encoding, compressing and hashing a shard is slower per core than a GPU teacher scores it
    # (most of it outside the GIL), so a fast teacher needs several writers
    # (tests/benchmarks/notes/capture.md, "Stage one end to end on the H200").
    workers = config.writer_threads or min(8, os.cpu_count() or 1)
    in_flight: deque[Future] = deque()
    total = int(sum(lengths[i * shard_size:(i + 1) * shard_size].sum() for i in todo))
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc="scoring", disable=not progress, smoothing=0.1)
    lock = threading.Lock()
    handoff = _Handoff(_HANDOFF_BYTES)

    def write(index, seqs, pipe: _Pipe) -> None:
        t0 = time.perf_counter()
        shard_rows = None if not rows_of else {
            name: parts[index * shard_size:(index + 1) * shard_size] for name, parts in rows_of.items()}
        try:
            writer.write_shard(index, seqs, pipe.blocks(), shard_rows)
        finally:
            pipe.stop_reading()
        with lock:
            report.writer_seconds += time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cache-writer") as pool:
        try:
            for index in todo:
                seqs = sequences[index * shard_size:(index + 1) * shard_size]
                # At most one shard per writer in flight, each with a thread reading its rows as
                # they come; waiting here means the writers are the bottleneck.
                t0 = time.perf_counter()
                while len(in_flight) >= workers or (in_flight and in_flight[0].done()):
                    in_flight.popleft().result()
                report.writer_wait_seconds += time.perf_counter() - t0
                pipe = handoff.pipe()
                in_flight.append(pool.submit(write, index, seqs, pipe))
                try:
                    _score_shard(seqs, index * shard_size, backend, config, pipe, report, bar)
                except DistillUserError as e:  # e.g. a served teacher that stopped answering
                    pipe.abort()
                    raise DistillUserError(f"shard {index}: {e}") from None
                except BaseException:
                    pipe.abort()  # its writer removes the partial shard
                    raise
                pipe.close()
                report.written_shards += 1
            t0 = time.perf_counter()
            while in_flight:
                in_flight.popleft().result()
            report.writer_wait_seconds += time.perf_counter() - t0
        finally:
            # On an interrupt, let shards already handed over finish: they are complete work.
            bar.close()


def _score_shard(seqs, first, backend, config, pipe: "_Pipe", report, bar) -> None:
    """Score the sequences ``seqs`` of one shard; ``first`` is the index of seqs[0] in the cache."""
    for b in range(0, len(seqs), config.batch_size):
        batch = seqs[b:b + config.batch_size]
        t0 = time.perf_counter()
        indices = list(range(first + b, first + b + len(batch)))
        for block in _row_blocks(backend, batch, config, indices):
            report.teacher_seconds += time.perf_counter() - t0
            t1 = time.perf_counter()
            pipe.put(block)
            report.writer_wait_seconds += time.perf_counter() - t1
            report.tokens_scored += block.num_positions
            bar.update(block.num_positions)
            t0 = time.perf_counter()
        report.teacher_seconds += time.perf_counter() - t0


def _row_blocks(backend: TeacherBackend, batch: list[np.ndarray], config: CacheConfig,
                indices: list[int]) -> Iterable[TeacherTargets]:
    """The batch's rows as the backend produces them: its ``score_blocks`` where it has one (rows
    of a long sequence chunk by chunk), else its ``score`` (one block per sequence). indices: the
    sequences' indices in the cache (a sampled cache's draws depend on them)."""
    if config.targets != "topk":
        return (block for _, block in backend.score_blocks(batch, config.slots, sampling=config.sampling,
                                                           indices=indices))
    score_blocks = getattr(backend, "score_blocks", None)
    if score_blocks is None:
        return backend.score(batch, config.k)
    return (block for _, block in score_blocks(batch, config.k))


class _Aborted(Exception):
    """The teacher thread stopped in the middle of a shard."""


class _Handoff:
    """Row blocks passed from the teacher thread to writer threads, one pipe per shard, with at
    most ``max_bytes`` of them handed over and not yet taken, over all pipes (one block always
    passes, so a block larger than the bound still moves)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.queued = max_bytes, 0
        self.cond = threading.Condition()

    def pipe(self) -> "_Pipe":
        return _Pipe(self)


class _Pipe:
    def __init__(self, handoff: _Handoff):
        self._handoff, self._cond = handoff, handoff.cond
        self._items: deque[tuple[TeacherTargets, int]] = deque()
        self._closed = self._aborted = self._reader_gone = False

    def put(self, block: TeacherTargets) -> None:
        """Teacher side; waits while the handoff is full. Dropped once the reader has stopped (its
        error surfaces from the writer's future)."""
        nbytes = sum(a.nbytes for a in block.arrays if a is not None)
        h = self._handoff
        with self._cond:
            while h.queued and h.queued + nbytes > h.max_bytes and not self._reader_gone:
                self._cond.wait()
            if self._reader_gone:
                return
            self._items.append((block, nbytes))
            h.queued += nbytes
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def blocks(self) -> Iterator[TeacherTargets]:
        """Writer side: the blocks in order until ``close``; raises ``_Aborted`` after ``abort``."""
        while True:
            with self._cond:
                while not (self._items or self._closed or self._aborted):
                    self._cond.wait()
                if self._aborted:
                    raise _Aborted("the teacher stopped in the middle of this shard")
                if not self._items:
                    return
                block, nbytes = self._items.popleft()
                self._handoff.queued -= nbytes
                self._cond.notify_all()
            yield block

    def stop_reading(self) -> None:
        """Writer side, when it is done (or failed): drop what is left, unblock the teacher."""
        with self._cond:
            self._reader_gone = True
            self._handoff.queued -= sum(nbytes for _, nbytes in self._items)
            self._items.clear()
            self._cond.notify_all()
