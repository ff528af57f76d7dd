"""Stage one: score packed sequences with a teacher backend and write a cache.

Teacher compute runs on the calling thread; shards are encoded, compressed and written on a
background thread, so a GPU teacher never waits for the disk unless the writer falls behind
(the run summary reports both times so that shows).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from teacher_cache.backends.base import TeacherBackend
from teacher_cache.codecs import get_codec
from distill.errors import DistillUserError
from teacher_cache.targets import TeacherTargets

log = logging.getLogger(__name__)

STORAGE_FORMATS = ("zarr", "parquet")


@dataclass
class CacheConfig:
    """How stage one writes its cache."""

    out: Path  # cache directory (created; an interrupted run there is resumed)
    k: int = 100  # top-k entries stored per position
    value_codec: str = "sqrt8"  # fp32 | bf16 | fp16 | sqrt8 (see teacher_cache/codecs.py)
    storage: str = "parquet"  # parquet | zarr (Zarr v3); parquet writes ~2.4x cheaper (RESULTS.md)
    shard_size: int = 64  # sequences per shard
    batch_size: int = 8  # sequences per teacher call
    temperature: float = 1.0  # cache temperature: stored log-probs are log_softmax(logits / T)
    writer_threads: int = 0  # shards encoded and written in parallel; 0 = min(8, CPU count)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.k < 1:
            raise DistillUserError(f"k must be >= 1, got {self.k}")
        if self.storage not in STORAGE_FORMATS:
            raise DistillUserError(f"storage format must be one of {', '.join(STORAGE_FORMATS)}, got {self.storage!r}")
        get_codec(self.value_codec)  # raises a clear error for an unknown codec
        if self.shard_size < 1 or self.batch_size < 1:
            raise DistillUserError(f"shard_size and batch_size must be >= 1, got {self.shard_size}, {self.batch_size}")
        if not self.temperature > 0:
            raise DistillUserError(f"temperature must be > 0, got {self.temperature}")


@dataclass
class BuildReport:
    """What a build did: the manifest path and where the time went."""

    cache_dir: Path
    cache_id: str
    already_complete: bool = False
    resumed_shards: int = 0
    written_shards: int = 0
    tokens_scored: int = 0
    teacher_seconds: float = 0.0  # time inside backend.score
    writer_seconds: float = 0.0  # summed over writer threads
    writer_wait_seconds: float = 0.0  # time the teacher thread waited for writers to catch up
    wall_seconds: float = 0.0
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
) -> BuildReport:
    """Score ``sequences`` (int32 token ids each) and write them as a cache at ``config.out``.

    tokenizer: ``identity.tokenizer_info`` of the teacher's tokenizer. data: {"source",
    "fingerprint", "seq_len"} of the packed corpus. Re-running with the same arguments after an
    interruption resumes: finished shards are kept and only the missing ones are scored.
    """
    from teacher_cache.writer import CacheWriter

    if not sequences:
        raise DistillUserError("the corpus produced no sequences; give more text or a shorter --seq-len")
    if config.k > backend.vocab_size:
        raise DistillUserError(f"k must be in [1, vocab_size={backend.vocab_size}], got {config.k}")
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    if lengths.min() < 2:
        raise DistillUserError(f"every sequence needs at least 2 tokens, got one of {lengths.min()}")

    identity = cache_identity(backend.describe(), config, tokenizer=tokenizer, data=data, lengths=lengths)
    start = time.perf_counter()
    writer = CacheWriter(config.out, identity)
    report = BuildReport(cache_dir=config.out, cache_id=writer.cache_id)
    try:
        if writer.is_complete:
            report.already_complete = True
            log.info("cache %s (%s) is already complete; nothing to do", config.out, writer.cache_id)
            return report
        num_shards = -(-len(sequences) // config.shard_size)
        done = writer.done_shards()
        todo = [i for i in range(num_shards) if i not in done]
        report.resumed_shards = len(done)
        if done:
            log.info("resuming %s: %d of %d shards already written, %d to go", config.out, len(done), num_shards, len(todo))
        _score_and_write(sequences, lengths, todo, backend, config, writer, report, progress)
        writer.finalize()
    finally:
        writer.close()
    report.wall_seconds = time.perf_counter() - start
    return report


def cache_identity(teacher: dict, config: CacheConfig, *, tokenizer: dict, data: dict, lengths) -> dict:
    """The cache's identity (the manifest's spec before storage codecs are filled in).

    teacher: a backend's ``describe()``, or the same dict built without loading the model.
    """
    return {
        "teacher": teacher,
        "tokenizer": tokenizer,
        "data": {**data, "sequences": len(lengths), "tokens": int(np.sum(lengths))},
        "targets": {"k": config.k, "value_codec": config.value_codec, "temperature": config.temperature},
        "storage": {"format": config.storage, "shard_size": config.shard_size},
    }


def complete_cache_id(out: Path, identity: dict) -> str | None:
    """The cache id if ``out`` already holds this cache, complete; else None. Reads only the manifest.

    Lets a caller skip loading a teacher whose cache exists (``distill run`` reusing a cache).
    """
    from teacher_cache.manifest import CacheSpec, identity_diff, load_manifest, manifest_path

    if not manifest_path(out).exists():
        return None
    existing = load_manifest(out)
    asked = CacheSpec.from_dict({**identity, "storage": {**identity["storage"], "codecs": {}}})
    if existing.status != "complete" or identity_diff(existing.spec, asked):
        return None
    return existing.cache_id


def _score_and_write(sequences, lengths, todo, backend, config, writer, report, progress) -> None:
    shard_size = config.shard_size
    # Encoding, compressing and hashing a shard runs at ~100k tokens/s per core (Parquet; most of
    # it outside the GIL), so a fast GPU teacher needs several writers (RESULTS.md, runs B-E).
    workers = config.writer_threads or min(8, os.cpu_count() or 1)
    in_flight: deque[Future] = deque()
    total = int(sum(lengths[i * shard_size:(i + 1) * shard_size].sum() for i in todo))
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc="scoring", disable=not progress, smoothing=0.1)
    lock = threading.Lock()

    def write(index, seqs, parts) -> None:
        t0 = time.perf_counter()
        writer.write_shard(index, seqs, TeacherTargets.concat(parts))  # the copy stays off the teacher thread
        with lock:
            report.writer_seconds += time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cache-writer") as pool:
        try:
            for index in todo:
                seqs = sequences[index * shard_size:(index + 1) * shard_size]
                parts: list[TeacherTargets] = []
                for b in range(0, len(seqs), config.batch_size):
                    batch = seqs[b:b + config.batch_size]
                    t0 = time.perf_counter()
                    parts.extend(backend.score(batch, config.k))
                    report.teacher_seconds += time.perf_counter() - t0
                    tokens = sum(len(s) for s in batch)
                    report.tokens_scored += tokens
                    bar.update(tokens)
                # At most one shard per writer in flight: memory stays bounded, the drain at the end
                # is short, and waiting here means the writers are the bottleneck.
                t0 = time.perf_counter()
                while len(in_flight) >= workers or (in_flight and in_flight[0].done()):
                    in_flight.popleft().result()
                report.writer_wait_seconds += time.perf_counter() - t0
                in_flight.append(pool.submit(write, index, seqs, parts))
                report.written_shards += 1
            t0 = time.perf_counter()
            while in_flight:
                in_flight.popleft().result()
            report.writer_wait_seconds += time.perf_counter() - t0
        finally:
            # On an interrupt, let shards already handed over finish: they are complete work.
            bar.close()
