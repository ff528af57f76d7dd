"""The configuration of a stage-two run: `TrainConfig`, composed of its parts' configs, each beside
its owner. Torch-free: the CLI and recipes import it for their option defaults and keys.

Every field has a flat name, unique across the parts, that is also its CLI option
(`--warmup-steps`) and its recipe key ([train] warmup_steps).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from distill.configs import ConfigError, check_types, option, require
from distill.errors import DistillUserError
from student.long_context.config import LongContextConfig
from student.loss_config import LossConfig
from student.offload.config import OffloadConfig
from student.optim.config import OptimizerConfig
from student.schedule import ScheduleConfig
from student.sparse_ffn_config import SparseFFNConfig

__all__ = ["CHANGEABLE", "FREE", "TrainConfig"]

# Settings a rerun may change; the run continues from its checkpoint and metrics.jsonl records each
# change. They alter the learning-rate schedule, the optimizer's hyperparameters (not its kind or
# the shape of its state), the sparse FFN's policy, how sequences are chunked and where their
# keys and values live (exact) or which past pages a chunk attends (sparse pages), where the decoder
# layers' weights, states and activations live (offload: the same results), or where the cache lives
# (it is identified by its id), never the model or the data.
CHANGEABLE = ("cache", "steps", "warmup_steps", "min_lr_ratio", "lr", "weight_decay", "clip_grad", "foam_scale",
              "l1", "sparse_kernel", "dead_reinit", "dead_window", "chunk_tokens", "page_tokens", "kv_offload",
              "offload_pages", "checkpoint_layers", "sparse_pages", "keep_attention_chunks", "offload", "gpu_memory",
              "host_memory", "chunk_candidates")
# Settings of how often things are logged, evaluated or saved, and where, and how many decoded shards the
# loader keeps (not what it reads): free to change, not recorded.
FREE = ("out", "eval_every", "eval_sequences", "save_every", "keep_checkpoints", "log_every", "loader_shards")


@dataclass
class TrainConfig:
    """Stage two. Give `student` (an HF folder) or `teacher` + `num_layers` (prune the teacher).

    Made of the configs of its parts (schedule, optim, loss, sparse), each beside its owner. Every
    field has a flat name, unique across the parts, that is also its CLI option (`--warmup-steps`)
    and its recipe key ([train] warmup_steps): `from_flat`, `with_flat` and `to_flat` use them.
    """

    out: str | Path = option(
        help="Run directory (metrics, checkpoints, final student); rerun to resume.", flags=("--out", "-o"))
    cache: tuple[str, ...] = option(
        (), help="Teacher cache directory (from cache-teacher), or its fsspec URL (s3://bucket/cache, gs://...); repeat it "
             "to mix several caches of one tokenizer (--cache-weights).", flags=("--cache", "-c"))
    cache_weights: tuple[float, ...] | str = option(
        (), "With several --cache: each cache's share of the training sequences, comma-separated (0.7,0.3; normalised "
            "to sum 1). Default: equal shares.")
    ensemble: tuple[str, ...] | str = option(
        (), "Instead of --cache: several teachers' caches of one corpus, comma-separated (A,B); each position's target "
            "is their mixture at --ensemble-weights (default: equal), top-k and tails merged.")
    ensemble_weights: tuple[float, ...] | str = option(
        (), "Each --ensemble teacher's weight in the mixture, comma-separated (0.5,0.5; normalised to sum 1).")
    ensemble_k: int | None = option(
        None, "Ids an ensemble's target keeps a position, the most probable of the teachers' top-k (default: the largest "
              "k among the caches); the rest joins the tail. Top-k caches only: a sampled ensemble keeps every draw.")
    student: str | Path | None = option(None, "Initial student HF folder.")
    teacher: str | Path | None = option(
        None, "Prune the initial student from this HF folder (with --num-layers); default: the embedded teacher.")
    num_layers: int | None = option(None, "Layers kept when pruning from the teacher (evenly spaced).")
    tokenizer: str | Path | None = option(
        None, "Folder with the tokenizer files (default: the student's or teacher's folder).")
    embedding_init: Literal["transplant", "random"] = option(
        "transplant", "A pruned student's embedding and lm-head: transplant (the teacher's; for another --tokenizer, each "
                      "token the mean of the teacher tokens spelling it) or random (normal, std 0.02). Pruning only.")
    cross_tokenizer: Literal["auto", "off", "byte-prefix"] = option(
        "auto", "A student whose tokenizer is not the cache's: auto (byte-prefix when they differ), byte-prefix (also "
                "for the same tokenizer; the targets are then the cache's own), off (refuse another tokenizer). With "
                "another tokenizer add --ce-weight 0.5 (rows cross_tokenizer/byte-prefix+ce-seed*, RESULTS.md).")
    batch_size: int = option(
        8, "Sequences per micro-batch (under torchrun: over all processes, each takes an equal share).")
    grad_accum: int = option(1, "Micro-batches per optimizer step.")
    seq_len: int | None = option(None, "Crop cached sequences to this many tokens (default: as cached).")
    heldout: int = option(16, "Cached sequences held out for evaluation (evenly spaced, fixed).")
    loader_shards: int = option(
        4, "Decoded cache shards the loader keeps per cache, the most recently read. Fewer hold less host memory (a "
           "cache of long sequences, many to a shard, decodes gigabytes a shard: try 1); more decode a shard again "
           "less often.")
    eval_every: int = option(100, "Evaluate on the held-out sequences every N steps (0: at the start and the end).")
    eval_sequences: int | None = option(None, "Held-out sequences each evaluation uses (default: all).")
    save_every: int = option(200, "Checkpoint every N steps (and at the end; the newest --keep-checkpoints are kept).")
    keep_checkpoints: int = option(
        2, "Checkpoints kept, the newest; an older one is deleted once a newer one is written (each holds the "
           "weights and the optimizer state: a rerun resumes from the newest, --resume-from from any kept).")
    log_every: int = option(10, "A metrics row every N steps.")
    device: str = option("auto", "auto, cpu, cuda or cuda:N.")
    dtype: Literal["auto", "float32", "bfloat16"] = option(
        "auto", "Autocast dtype: auto (bfloat16 on a GPU, float32 on a CPU), float32 or bfloat16.")
    seed: int = option(0, "Seed of the data order and initialisation.")
    deterministic: bool = option(False, "Deterministic kernels (bit-identical resume on a CPU).")
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)  # steps, warmup_steps, min_lr_ratio
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)  # optimizer, lr, weight_decay, clip_grad, foam_*
    loss: LossConfig = field(default_factory=LossConfig)  # tail, temperature, ce_weight
    sparse: SparseFFNConfig = field(default_factory=SparseFFNConfig)  # sparse_ffn, l1, sparse_kernel, dead_*
    long: LongContextConfig = field(default_factory=LongContextConfig)  # chunk_tokens, page_tokens, kv_offload, ...
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # offload (none | auto | PLAN.json), gpu_memory, host_memory

    def __post_init__(self):
        self.cache = (str(self.cache),) if isinstance(self.cache, (str, Path)) else tuple(map(str, self.cache))
        self.ensemble = tuple(p for p in self.ensemble.split(",") if p) if isinstance(self.ensemble, str) \
            else tuple(map(str, self.ensemble or ()))
        self.cache_weights, self.ensemble_weights = _weights(self.cache_weights), _weights(self.ensemble_weights)
        if self.ensemble:  # the first teacher's cache gives the run its text
            if self.cache not in ((), self.ensemble[:1]):
                raise ConfigError("ensemble", "is given with --cache: an ensemble's caches hold one corpus; give "
                                              "--ensemble A,B alone (several --cache mix corpora)")
            self.cache = self.ensemble[:1]
        check_types(self)
        require("cache", self.cache, len(self.cache) >= 1, "given at least once (or --ensemble A,B)")
        require("ensemble", ",".join(self.ensemble), len(self.ensemble) != 1, "two caches or more, or left out")
        for name, caches in (("cache_weights", self.cache), ("ensemble_weights", self.ensemble)):
            weights = getattr(self, name)
            require(name, ",".join(f"{w:g}" for w in weights), not weights or (
                len(weights) == len(caches) and all(w >= 0 for w in weights) and sum(weights) > 0),
                f"one weight >= 0 per --{name.split('_')[0]} ({len(caches)}), summing to a positive number")
        require("ensemble_k", self.ensemble_k, self.ensemble_k is None or self.ensemble_k >= 1,
                "a positive integer, or left out")
        if (self.student is None) == (self.teacher is None):
            raise DistillUserError("give exactly one of `student` (an HF folder) or `teacher` + `num_layers`, "
                                   f"got student={self.student!r}, teacher={self.teacher!r}")
        if self.teacher is not None and self.num_layers is None:
            raise DistillUserError("`num_layers` is required with `teacher` (how many layers the student keeps)")
        if self.student is not None and self.embedding_init != "transplant":
            raise ConfigError("embedding_init", f"is {self.embedding_init!r}, but it applies only to a student pruned "
                                                "from the teacher (teacher + num_layers); leave it out with a student folder")
        require("num_layers", self.num_layers, self.num_layers is None or self.num_layers >= 1,
                "a positive integer, or leave it out")
        for name in ("batch_size", "grad_accum", "log_every", "keep_checkpoints", "loader_shards"):
            require(name, getattr(self, name), getattr(self, name) >= 1, "an integer >= 1")
        for name in ("eval_every", "save_every", "seed"):
            require(name, getattr(self, name), getattr(self, name) >= 0, "an integer >= 0")
        require("heldout", self.heldout, self.heldout >= 1, "an integer >= 1 (evaluation needs held-out sequences)")
        require("seq_len", self.seq_len, self.seq_len is None or self.seq_len >= 2, "an integer >= 2, or leave it out")
        require("eval_sequences", self.eval_sequences, self.eval_sequences is None or self.eval_sequences >= 1,
                "a positive integer, or leave it out")
        if self.offload.offload != "none" and self.sparse.sparse_ffn:
            raise ConfigError("offload", f"is {self.offload.offload!r}: offloaded training does not run the sparse "
                                         "FFN yet; drop --sparse-ffn or use --offload none")

    @classmethod
    def from_flat(cls, **values) -> TrainConfig:
        """Build from flat names (`steps=`, `lr=`, `tail=`, ...); each part validates its own fields."""
        parts = {name: part_cls(**{k: values.pop(k) for k in list(values) if k in _field_names(part_cls)})
                 for name, part_cls in _PARTS.items()}
        unknown = sorted(set(values) - _field_names(cls))
        if unknown:
            raise DistillUserError(f"unknown training setting(s) {', '.join(unknown)}; "
                                   f"known: {', '.join(sorted([*cls.flat_defaults(), 'cache', 'out']))}")
        return cls(**values, **parts)

    def with_flat(self, **changes) -> TrainConfig:
        """A copy with the fields of these flat names changed (validated again)."""
        return TrainConfig.from_flat(**{**self.to_flat(), **changes})

    def to_flat(self) -> dict[str, Any]:
        """Every field by its flat name (the form run.json and recipes hold: a tuple as a list)."""
        value = lambda v: list(v) if isinstance(v, tuple) else v
        flat = {f.name: value(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in _PARTS}
        for name in _PARTS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat

    @classmethod
    def flat_fields(cls) -> list[tuple[dataclasses.Field, Any]]:
        """(field, type hint) of every flat name, TrainConfig's own first, then each part's: the options
        of `distill train-student` (distill/cli_options.py makes them)."""
        own = [(f, typing.get_type_hints(cls)[f.name]) for f in dataclasses.fields(cls) if f.name not in _PARTS]
        return own + [(f, typing.get_type_hints(part)[f.name]) for part in _PARTS.values() for f in dataclasses.fields(part)]

    @classmethod
    def flat_defaults(cls) -> dict[str, Any]:
        """The default of every flat setting that has one, in to_flat's form (all but `out`, and `cache`:
        the run's data, given by --cache or --ensemble)."""
        value = lambda v: list(v) if isinstance(v, tuple) else v
        own = {f.name: value(f.default) for f in dataclasses.fields(cls)
               if f.name not in (*_PARTS, "cache") and f.default is not dataclasses.MISSING}
        for part_cls in _PARTS.values():
            own.update({f.name: f.default for f in dataclasses.fields(part_cls)})
        return own


_PARTS = {"schedule": ScheduleConfig, "optim": OptimizerConfig, "loss": LossConfig, "sparse": SparseFFNConfig,
          "long": LongContextConfig, "offload": OffloadConfig}


def _weights(value) -> tuple[float, ...]:
    """cache_weights as a tuple of floats: from "0.7,0.3" (the CLI's and a recipe's form) or a sequence;
    None (the option not given) is ()."""
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            return tuple(float(part) for part in value.split(",") if part.strip())
        except ValueError:
            raise ConfigError("cache_weights", f"must be numbers separated by commas (0.7,0.3), got {value!r}") from None
    return tuple(float(w) if isinstance(w, int) and not isinstance(w, bool) else w for w in value)


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


_all_flat = [n for n in _field_names(TrainConfig) if n not in _PARTS] + [n for c in _PARTS.values() for n in _field_names(c)]
assert len(_all_flat) == len(set(_all_flat)), "flat names must be unique across TrainConfig's parts"
