"""Stage two: train a student against a teacher cache, in one readable loop.

Run directory (`out`):
  run.json            the resolved config (flat names: TrainConfig.to_flat()), the cache's id and
                      temperature, the student's identity and tokenizer hash, and with offload the
                      plan the run trains with (offload_plan: OffloadPlan.to_dict(), its predictions;
                      with --chunk-candidates the config's chunk_tokens, kv_offload and offload_pages
                      are the plan's choice, and its chunk_choices every candidate considered; a plan
                      that keeps the attention outputs of fewer chunks sets keep_attention_chunks)
  metrics.jsonl       {"kind": "train", step, loss, kl, lr, grad_norm, tokens, tok_per_s,
                      optimizer_state_bytes, epoch, and on a GPU peak_gpu_bytes: the most
                      allocated since the previous row, and peak_gpu_reserved_bytes: the most the
                      caching allocator held, capped at --gpu-memory when given}; with offload also
                      offload_step_s (mean seconds of the window's steps, evaluation and checkpoints
                      left out),
                      offload_predicted_step_s / _gpu_peak_bytes / _host_peak_bytes (the plan's),
                      offload_phase_s and offload_predicted_phase_s (the last step's phases, measured and
                      predicted: student/planner.py's PHASES)
                      and offload_host_bytes (what the offloaded layers hold on the host); with a ReLU-gated (sparse FFN) student also
                      l1 (mean over layers of sum over d_ff of |h|, mean over tokens) and, per layer
                      over the steps since the previous row, ffn_nnz (mean non-zeros of h per token),
                      ffn_sparsity (1 - nnz / d_ff), ffn_dead (share of neurons zero on every token;
                      counted over the real tokens of the batches, padding left out),
                      ffn_overflow_rows / ffn_fallback_rows (kernel counts), ffn_reinit (gate
                      rows moved by dead_reinit), ffn_kernel (with sparse_kernel "twell");
                      {"kind": "eval", step, kl, ce, ppl, top1, tokens (+ ffn_nnz, ffn_sparsity,
                      ffn_dead for a sparse student)}; and {"kind": "change", step, changes: {name:
                      [old, new]}} where a rerun continued the run with other settings; {"kind":
                      "stop", step, reason: "non-finite", message} when a non-finite loss stopped the
                      run (a rerun resumes from its checkpoint and drops the row)
  run.pid             the process training the run (student/run_owner.py), removed when it returns
                      or raises; one left behind by a killed process names a dead pid
  initial_eval.json   the step-0 student on the evaluation sequences
  eval.json           initial / final student and teacher reference at the end
  checkpoints/, student/   see student/checkpoint.py

Rerunning `train` with the same config resumes from the last checkpoint; with deterministic=True
on the CPU the losses equal those of an uninterrupted run bit for bit. A rerun may change the
settings in CHANGEABLE (the schedule, more steps, the optimizer's hyperparameters, the sparse
FFN's policy, where the cache lives): the run continues from its checkpoint under the new ones.
Settings that change the model or the data make it another run, refused.

Only torch-free modules are imported at the top: the CLI imports TrainConfig for its option
defaults without loading torch; the loop imports what it runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from distill.configs import ConfigError, check_types, require
from distill.devices import resolve_device, resolve_dtype
from distill.errors import DistillUserError
from distill.files import atomic_write_json
from student import run_owner
from student.checkpoint import RunDirError
from student.long_context import LongContextConfig
from student.loss import LossConfig
from student.offload_plan import OffloadConfig, parse_bytes
from student.offload_run import (cap_allocator, caps_allocator, cuda_index, offload_figures, over_cap_message,
                                 plan_for_run, told_over_budget)
from student.optim.config import OptimizerConfig
from student.schedule import ScheduleConfig, lr_factor
from student.sparse_ffn import SparseFFNConfig

if TYPE_CHECKING:
    from student.evaluate import EvalResult

__all__ = ["TrainConfig", "TrainReport", "train", "RunDirError", "NonFiniteLossError", "CHANGEABLE"]

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
# Settings of how often things are logged, evaluated or saved, and where: free to change, not recorded.
_FREE = ("out", "eval_every", "eval_sequences", "save_every", "log_every")
_TEST_EXIT_ENV = "DISTILL_TEST_EXIT_AFTER_STEP"  # tests only: os._exit after this step, as a kill would
logger = logging.getLogger(__name__)


class NonFiniteLossError(DistillUserError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class TrainConfig:
    """Stage two. Give `student` (an HF folder) or `teacher` + `num_layers` (prune the teacher).

    Made of the configs of its parts (schedule, optim, loss, sparse), each beside its owner. Every
    field has a flat name, unique across the parts, that is also its CLI option (`--warmup-steps`)
    and its recipe key ([train] warmup_steps): `from_flat`, `with_flat` and `to_flat` use them.
    """

    cache: str | Path  # teacher cache directory (read only; several runs may share it; known by its id)
    out: str | Path  # run directory; rerunning with the same config resumes from its last checkpoint
    student: str | Path | None = None  # HF folder of the initial student
    teacher: str | Path | None = None  # HF folder of the teacher, pruned to `num_layers` layers as the initial student
    num_layers: int | None = None  # layers kept from the teacher (evenly spaced, first and last included)
    tokenizer: str | Path | None = None  # folder with the tokenizer files (default: the student/teacher folder)
    batch_size: int = 8  # sequences per micro-batch (over all processes under torchrun: student/distributed.py)
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int | None = None  # crop sequences to this many positions (None: as cached)
    heldout: int = 16  # evenly spaced sequences kept out of training for evaluation
    eval_every: int = 100  # evaluate every this many steps (0: only at the start and the end)
    eval_sequences: int | None = None  # held-out sequences each evaluation uses (None: all)
    save_every: int = 200  # checkpoint every this many steps (and at the end; the last 2 are kept)
    log_every: int = 10  # metrics row every this many steps
    device: str = "auto"  # "auto" (cuda if available) | "cpu" | "cuda" | "cuda:N"
    # autocast dtype: "auto" (bfloat16 on a GPU, float32 on a CPU: distill.devices.resolve_dtype)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    seed: int = 0  # data order and crops
    deterministic: bool = False  # torch deterministic algorithms (exact resume on the CPU needs it)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)  # steps, warmup_steps, min_lr_ratio
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)  # optimizer, lr, weight_decay, clip_grad, foam_*
    loss: LossConfig = field(default_factory=LossConfig)  # tail, temperature, ce_weight
    sparse: SparseFFNConfig = field(default_factory=SparseFFNConfig)  # sparse_ffn, l1, sparse_kernel, dead_*
    long: LongContextConfig = field(default_factory=LongContextConfig)  # chunk_tokens, page_tokens, kv_offload, ...
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # offload (none | auto | PLAN.json), gpu_memory, host_memory

    def __post_init__(self):
        check_types(self)
        if (self.student is None) == (self.teacher is None):
            raise DistillUserError("give exactly one of `student` (an HF folder) or `teacher` + `num_layers`, "
                                   f"got student={self.student!r}, teacher={self.teacher!r}")
        if self.teacher is not None and self.num_layers is None:
            raise DistillUserError("`num_layers` is required with `teacher` (how many layers the student keeps)")
        require("num_layers", self.num_layers, self.num_layers is None or self.num_layers >= 1,
                "None or an integer >= 1")
        for name in ("batch_size", "grad_accum", "log_every"):
            require(name, getattr(self, name), getattr(self, name) >= 1, "an integer >= 1")
        for name in ("eval_every", "save_every", "seed"):
            require(name, getattr(self, name), getattr(self, name) >= 0, "an integer >= 0")
        require("heldout", self.heldout, self.heldout >= 1, "an integer >= 1 (evaluation needs held-out sequences)")
        require("seq_len", self.seq_len, self.seq_len is None or self.seq_len >= 2, "None or an integer >= 2")
        require("eval_sequences", self.eval_sequences, self.eval_sequences is None or self.eval_sequences >= 1,
                "None or an integer >= 1")
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
                                   f"known: {', '.join(sorted(cls.flat_defaults()) + ['cache', 'out'])}")
        return cls(**values, **parts)

    def with_flat(self, **changes) -> TrainConfig:
        """A copy with the fields of these flat names changed (validated again)."""
        return TrainConfig.from_flat(**{**self.to_flat(), **changes})

    def to_flat(self) -> dict[str, Any]:
        """Every field by its flat name (the form run.json and recipes hold)."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _PARTS}
        for name in _PARTS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat

    @classmethod
    def flat_defaults(cls) -> dict[str, Any]:
        """The default of every flat field that has one (all but `cache` and `out`)."""
        own = {f.name: f.default for f in dataclasses.fields(cls)
               if f.name not in _PARTS and f.default is not dataclasses.MISSING}
        for part_cls in _PARTS.values():
            own.update({f.name: f.default for f in dataclasses.fields(part_cls)})
        return own


_PARTS = {"schedule": ScheduleConfig, "optim": OptimizerConfig, "loss": LossConfig, "sparse": SparseFFNConfig,
          "long": LongContextConfig, "offload": OffloadConfig}


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


_all_flat = [n for n in _field_names(TrainConfig) if n not in _PARTS] + [n for c in _PARTS.values() for n in _field_names(c)]
assert len(_all_flat) == len(set(_all_flat)), "flat names must be unique across TrainConfig's parts"


@dataclass
class TrainReport:
    run_dir: str
    student_dir: str
    steps: int  # steps done in total
    resumed_from: int  # step of the checkpoint this call started from (0: fresh)
    final_loss: float | None  # loss of the last step this call ran (None if it ran none)
    initial_eval: EvalResult | None  # the step-0 student (None when a resumed run has no record of it)
    final_eval: EvalResult
    teacher_eval: EvalResult  # the teacher itself, from the cache


# --- setup --------------------------------------------------------------------------------------


def _resolve(config: TrainConfig) -> TrainConfig:
    """Absolute paths, the device and dtype "auto" resolved, and the warmup as a number of steps."""
    from teacher_cache.location import absolute_cache  # a URL as given (s3://...), a path made absolute

    absolute = lambda p: None if p is None else str(Path(p).expanduser().resolve())
    device = resolve_device(config.device)
    offload = config.offload.offload
    return config.with_flat(
        offload=offload if offload in ("none", "auto") else absolute(offload),
        cache=absolute_cache(config.cache), out=absolute(config.out), student=absolute(config.student),
        teacher=absolute(config.teacher), tokenizer=absolute(config.tokenizer or config.student or config.teacher),
        device=device, dtype=resolve_dtype(config.dtype, device), warmup_steps=config.schedule.warmup)


def _initial_student(config: TrainConfig, device: str):
    """(model on `device`, identity for run.json)."""
    from student.config import StudentConfig
    from student.model import Student, to_relu_gate

    if config.student is not None and not any(Path(config.student).glob("*.safetensors")):
        # A folder with only config.json: a student of that shape, randomly initialised (seeded).
        cfg = StudentConfig.from_hf_dict(json.loads((Path(config.student) / "config.json").read_text()))
        model, init = Student(cfg).to(device), f"config:{config.student}"
    elif config.student is not None:
        model, init = Student.from_pretrained(config.student, device=device), f"student:{config.student}"
    else:
        model = Student.from_teacher_pruned(config.teacher, config.num_layers, device=device)
        init = f"teacher:{config.teacher}:num_layers={config.num_layers}"
    if config.sparse.sparse_ffn and not model.config.sparse_ffn:
        to_relu_gate(model)
        logger.info("sparse_ffn: the SwiGLU student (%s) now has a ReLU gate, same weights; L1 coefficient %g",
                    init, config.sparse.l1)
        init += ":relu-gate"
    elif model.config.sparse_ffn and not config.sparse.sparse_ffn:
        logger.info("the student has a ReLU-gated FFN but sparse_ffn is off: training it without the L1 penalty")
    return model, {"init": init, "config": model.config.to_hf_dict()}


def _check_run_dir(out: Path, run: dict) -> dict:
    """In a new run dir write run.json and return {}; in an existing one refuse another run, and
    return the CHANGEABLE settings that differ, {name: [old, new]}."""
    path = out / "run.json"
    if out.exists() and not out.is_dir():
        raise ConfigError("out", f"is an existing file ({out}); give a new or empty directory")
    if not path.exists():
        if out.exists() and any(out.iterdir()):
            raise RunDirError(f"{out} is not empty and holds no run.json; give `out` a new or empty directory")
        try:
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, run)
        except OSError as e:
            raise ConfigError("out", f"cannot be written ({out}: {e.strerror or e}); give a directory you can "
                                     "write to") from None
        return {}
    old = json.loads(path.read_text())
    defaults = TrainConfig.flat_defaults()  # a field added after the run was written reads as its default
    was = lambda k: old["config"].get(k, defaults.get(k))
    new = run["config"]
    refused = [f"{k}: {was(k)!r} -> {v!r}" for k, v in new.items()
               if k not in _FREE + CHANGEABLE and was(k) != v]
    refused += [k for k in ("cache_id", "student", "tokenizer_hash") if old.get(k) != run.get(k)]
    if refused:
        raise RunDirError(f"{out} holds another run (run.json differs in {'; '.join(refused)}, which changes the "
                          "model or the data); use a new `out`, or rerun with the run's settings (these may change: "
                          f"{', '.join(CHANGEABLE)})")
    return {k: [was(k), v] for k, v in new.items() if k in CHANGEABLE and was(k) != v}


# --- the loop -----------------------------------------------------------------------------------


def _loss(hidden, terms, rows, model, config: TrainConfig, *, cache_temperature: float, policy=None, part=None):
    """(loss to backpropagate, KL at the distillation temperature) of the final hidden states
    [B, T, d] of `rows`: a micro-batch, or a chunk of one (`part`, a student.long_context.Part: the
    chunks' losses then sum to the micro-batch's); with a sparse FFN `policy`, the FFN's
    measurements go to it and the loss adds its L1 penalty."""
    import torch

    from student.loss import distill_loss

    hidden_ND = hidden.reshape(-1, hidden.shape[-1])
    if config.dtype == "bfloat16":  # the final norm returns fp32 under autocast; the lm-head matmuls run in bf16
        hidden_ND = hidden_ND.to(torch.bfloat16)
    # One call: the loss mixes CE in when 0 < ce_weight, and the KL term comes back beside it for the metrics.
    loss, kl = distill_loss(hidden_ND, model.lm_head_weight.to(hidden_ND.dtype), rows, config.loss,
                            cache_temperature=cache_temperature, check_ids=not config.device.startswith("cuda"),
                            whole=part.whole if part is not None else None)
    share = part.share if part is not None else 1.0
    if policy is not None:
        policy.observe(terms, share)
        penalty = policy.penalty(terms)
        if penalty is not None:
            loss = loss + penalty * share
    return loss, kl


def _micro_batch_backward(model, batch, config: TrainConfig, amp_dtype, *, cache_temperature: float, policy=None,
                          whole: tuple[int, int] | None = None):
    """Forward and backward of one micro-batch (host memory) scaled by 1 / grad_accum, whole or
    chunk by chunk (student/long_context.py); returns its (loss, KL), detached. whole: the (real
    rows, rows with a next token) of the micro-batch over all ranks when `batch` is this rank's
    part of it (student/distributed.py): the loss is then the part's share of the micro-batch's."""
    import torch

    from student.long_context import Part, chunk_recurrent_backward

    grad_scale = 1.0 / config.grad_accum
    loss_of = lambda hidden, terms, rows, part=None: _loss(hidden, terms, rows, model, config, policy=policy,
                                                             cache_temperature=cache_temperature, part=part)
    if config.long.chunk_tokens is not None:
        chunk_loss = lambda hidden, rows, terms, part: loss_of(hidden, terms, rows, part)
        return chunk_recurrent_backward(model, batch, chunk_loss, config.long, device=config.device,
                                        autocast_dtype=amp_dtype, grad_scale=grad_scale, whole=whole)
    part = None if whole is None else Part(*whole, share=batch.num_tokens / max(whole[0], 1))
    batch = batch.to(config.device, non_blocking=True)
    with torch.autocast(torch.device(config.device).type, dtype=amp_dtype, enabled=amp_dtype is not None):
        hidden, terms = model(batch.input_ids, token_mask=batch.mask, return_ffn_terms=True)
    loss, kl = loss_of(hidden, terms, batch, part)
    (loss * grad_scale).backward()
    return loss.detach(), kl.detach()


def train(config: TrainConfig, progress: bool = True, *, resume_from: int | None = None) -> TrainReport:
    """Train (or resume) the run described by `config`; returns what it did and the final evaluation.
    resume_from: continue from the kept checkpoint of this step instead of the latest (the newer
    ones, and a final student, are deleted)."""
    import torch

    schedule = config.schedule
    if schedule.warmup_steps is not None and schedule.warmup_steps >= schedule.steps:  # the default scales with the run
        logger.warning("warmup_steps %d >= steps %d: the whole run is warmup and the learning rate never decays",
                       schedule.warmup_steps, schedule.steps)
    config = _resolve(config)
    dist = _join_processes(config)
    progress = progress and (dist is None or dist.main)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    capped = caps_allocator(config)  # _train caps it once the run has planned; lifted below
    was_fraction = torch.cuda.get_per_process_memory_fraction(cuda_index(config.device)) if capped else None
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        if progress:
            from tqdm.contrib.logging import logging_redirect_tqdm

            with logging_redirect_tqdm():  # log lines (the evaluations) above the progress bar
                return _train(config, progress, resume_from, dist)
        return _train(config, progress, resume_from, dist)
    except torch.OutOfMemoryError as error:
        if not capped:
            raise
        raise DistillUserError(over_cap_message(config.offload.gpu_memory)) from error
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        if capped:
            torch.cuda.set_per_process_memory_fraction(was_fraction, cuda_index(config.device))
        if dist is not None:
            from student.distributed import teardown

            teardown()
        if dist is None or dist.main:  # rank 0 wrote it; other ranks reading it would race its removal
            run_owner.release(Path(config.out))


def _train(config: TrainConfig, progress: bool, resume_from: int | None, dist) -> TrainReport:
    import random

    import numpy as np
    import torch
    from tqdm.auto import tqdm

    from student.checkpoint import (checkpoint_step, checkpoints, is_sharded_checkpoint, latest_checkpoint,
                                    load_checkpoint, load_sharded_checkpoint, remove_stale, rewind, rewind_metrics,
                                    save_checkpoint, save_sharded_checkpoint, save_student)
    from student.distributed import (all_sum, global_rows, padded_to_longest_part, rank0_first, shard_model,
                                     sum_over_ranks_, unsharded_root)
    from student.data import CacheBatches, Prefetcher, split_indices, tokenizer_info_of
    from student.evaluate import EvalResult, evaluate_student, kl_note, teacher_reference
    from student.optim import build_optimizer, load_state_keeping_settings, state_bytes
    from student.optim.clip import clip_grad_norm_foreach
    from student.sparse_ffn import SparseFFNPolicy
    from teacher_cache.reader import CacheReader
    from teacher_cache.verify import check_shards

    out, device = Path(config.out), config.device
    main = dist is None or dist.main  # the process that writes the run directory
    if resume_from is not None and not (out / "run.json").exists():
        raise RunDirError(f"--resume-from {resume_from}: {out} holds no run to resume")
    random.seed(config.seed), np.random.seed(config.seed), torch.manual_seed(config.seed)

    tok = tokenizer_info_of(config.tokenizer)
    reader = CacheReader(config.cache, expect_vocab_size=tok["vocab_size"], expect_tokenizer_hash=tok["hash"])
    cache_temperature = reader.manifest.spec.targets.temperature
    config.loss.check_cache_temperature(cache_temperature, kind=reader.manifest.spec.targets.kind)
    config = config.with_flat(temperature=config.loss.distillation_temperature(cache_temperature))
    check_shards(config.cache)  # every shard's size and checksum, before anything is written
    train_idx, held_idx = split_indices(reader.num_sequences, config.heldout)
    offloading = config.offload.offload != "none"
    plan = plan_for_run(config)
    if plan is not None and plan.chunk_choices:  # the planner chose the chunk size and where the pages live
        config = config.with_flat(chunk_tokens=plan.chunk_tokens, **{
            name: getattr(plan, name) for name in ("kv_offload", "offload_pages") if getattr(plan, name) is not None})
    if plan is not None and plan.keep_attention_chunks is not None:  # the host memory planned for pass 1's outputs
        config = config.with_flat(keep_attention_chunks=plan.keep_attention_chunks)
    # Offloaded, the model is built in host memory: its decoder layers stay there (student/offload.py).
    model, identity = _initial_student(config, "cpu" if offloading else device)
    if model.config.vocab_size < tok["vocab_size"]:
        raise DistillUserError(f"the student's vocab size {model.config.vocab_size} is smaller than its "
                               f"tokenizer's {tok['vocab_size']}; use a student built for this tokenizer")
    steps = config.schedule.steps
    run = {"config": config.to_flat(), "cache_id": reader.manifest.cache_id, "cache_temperature": cache_temperature,
           "student": identity, "tokenizer_hash": tok["hash"]}

    def prepare_run_dir() -> dict:
        changes = _check_run_dir(out, run)
        run_owner.claim(out)
        if resume_from is not None:
            rewind(out, resume_from)
        remove_stale(out)
        return changes

    changes = rank0_first(dist, prepare_run_dir)
    if dist is not None:
        shard_model(model)

    eval_idx = held_idx[:config.eval_sequences] if config.eval_sequences else held_idx
    amp_dtype = torch.bfloat16 if config.dtype == "bfloat16" else None
    runtime = None
    if offloading:  # before the optimizer sees the params
        from student.offload import OffloadRuntime

        runtime = OffloadRuntime(model, plan, device, amp_dtype, accumulates=steps_accumulate(config))
    if runtime is not None:
        run["offload_plan"] = runtime.plan.to_dict()
        if caps_allocator(config):  # train() lifts it
            cap_allocator(parse_bytes(config.offload.gpu_memory, "gpu_memory"), device)

    def evaluate(step: int) -> EvalResult:  # every rank evaluates every sequence (the forward is collective)
        with unsharded_root(model, dist is not None):
            result = evaluate_student(model, reader, eval_idx, batch_size=config.batch_size, device=device,
                                      seq_len=config.seq_len, autocast_dtype=amp_dtype, long=config.long)
        if main:
            logger.info("eval at step %d: %s", step, result.summary())
        return result

    optimizer = build_optimizer(model, config.optim, device)
    # Its own reader: batches are built on a background thread while evaluation reads through `reader`.
    data = CacheBatches(CacheReader(config.cache), train_idx, config.batch_size, seq_len=config.seq_len,
                        seed=config.seed, pin_memory=device.startswith("cuda"),
                        part=(0, 1) if dist is None else (dist.rank, dist.world_size))
    policy = None if not model.config.sparse_ffn else \
        SparseFFNPolicy(config.sparse, model, device, config.seed, reduce=None if dist is None else sum_over_ranks_)
    step, last_saved = 0, None  # last_saved: (checkpoint, the loss of its step)
    if (ckpt := latest_checkpoint(out)) is not None:
        if dist is not None or is_sharded_checkpoint(ckpt):
            state, data_state = load_sharded_checkpoint(ckpt, model, optimizer)
        else:
            state, data_state = load_checkpoint(ckpt, model)
        if runtime is not None:
            runtime.refresh()
        step = int(state["step"])
        if steps < step:
            raise ConfigError("steps", f"is {steps}, below the run's last checkpoint at step {step}; give at least "
                                       "that many (more steps extend a finished run)")
        if "optimizer" in state:  # a sharded checkpoint's was loaded with the model
            load_state_keeping_settings(optimizer, state["optimizer"])
        data.load_state_dict(data_state)
        if policy is not None:
            policy.load_state_dict(state, model)
        last_saved = (ckpt, state.get("loss"))
    resumed_from = step
    metrics_path = out / "metrics.jsonl"
    if main:
        rewind_metrics(metrics_path, step)
    metrics = metrics_path.open("a") if main else open(os.devnull, "w")
    log = lambda row: (metrics.write(json.dumps(row) + "\n"), metrics.flush())
    if changes:
        logger.info("continuing from step %d with %s", step,
                    "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items()))
        log({"kind": "change", "step": step, "changes": changes})
    if main:
        atomic_write_json(out / "run.json", run)

    initial = None
    if step == 0:
        initial = evaluate(0)
        if main:
            atomic_write_json(out / "initial_eval.json", initial.to_dict())
        log({"kind": "eval", "step": 0, **initial.to_dict()})
    elif (out / "initial_eval.json").exists():
        initial = EvalResult.from_dict(json.loads((out / "initial_eval.json").read_text()))

    model.train()
    batches = Prefetcher(data)
    exit_after = int(os.environ.get(_TEST_EXIT_ENV, "-1"))
    loss_value, window_tokens, window_start = None, 0, time.perf_counter()
    window_step_s, window_steps = 0.0, 0  # time in the steps themselves (offload rows)
    over_budget_told = False
    _peak_gpu_bytes(device)  # the first row's window opens here: loading's and the profile's peaks are no step's
    bar = tqdm(total=steps, initial=step, disable=not progress, desc="train", unit="step")
    with bar, metrics, batches:
        while step < steps:
            step_start = time.perf_counter()
            lr = config.optim.lr * lr_factor(step, config.schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum, kl_sum, tokens = 0.0, 0.0, 0
            for _ in range(config.grad_accum):
                batch = next(batches)
                whole = None
                if dist is not None:
                    whole = global_rows(batch, device)
                    if config.long.chunk_tokens is not None:
                        batch = padded_to_longest_part(batch, device)
                loss, kl = _micro_batch_backward(model, batch, config, amp_dtype, cache_temperature=cache_temperature,
                                                 policy=policy, whole=whole)
                loss_sum, kl_sum, tokens = loss_sum + loss.item(), kl_sum + kl.item(), tokens + batch.num_tokens
            if dist is not None:  # each rank holds its rows' share of the means: their sum is the step's
                loss_sum, kl_sum, tokens = all_sum([loss_sum, kl_sum, tokens], device)
                tokens = int(tokens)
            if runtime is not None:
                runtime.finish_grads()
            max_norm = config.optim.clip_grad if config.optim.clip_grad > 0 else float("inf")
            grad_norm = (runtime.clip_grad_norm(max_norm) if runtime is not None  # the same clipping, no host pass
                         else clip_grad_norm_foreach(model.parameters(), max_norm))
            grad_norm = (grad_norm.full_tensor() if dist is not None else grad_norm).item()
            loss_value = loss_sum / config.grad_accum
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                kept = [checkpoint_step(c) for c in checkpoints(out)]
                message = _diverged_message(step + 1, loss_value, grad_norm, last_saved, kept)
                log({"kind": "stop", "step": step + 1, "reason": "non-finite", "message": message})
                raise NonFiniteLossError(message)
            if runtime is not None:
                runtime.step(optimizer)
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window_step_s, window_steps = window_step_s + time.perf_counter() - step_start, window_steps + 1
            if policy is not None:
                policy.end_step(model, step, config.grad_accum, tokens)
            window_tokens += tokens
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}")
            if step % config.log_every == 0 or step == steps:
                elapsed = time.perf_counter() - window_start
                peak = _peak_gpu_bytes(device)
                if runtime is not None and not over_budget_told:
                    over_budget_told = told_over_budget(runtime.plan, peak.get("peak_gpu_bytes"))
                log({"kind": "train", "step": step, "loss": loss_value, "kl": kl_sum / config.grad_accum, "lr": lr,
                     "grad_norm": grad_norm, "tokens": tokens, "tok_per_s": window_tokens / max(elapsed, 1e-9),
                     "optimizer_state_bytes": state_bytes(optimizer), "epoch": batches.epoch,
                     **peak, **(policy.metrics(model) if policy is not None else {}),
                     **(offload_figures(runtime, optimizer, window_step_s / window_steps) if runtime else {})})
                window_tokens, window_start = 0, time.perf_counter()
                window_step_s, window_steps = 0.0, 0
            if (config.eval_every and step % config.eval_every == 0) or step == steps:
                log({"kind": "eval", "step": step, **evaluate(step).to_dict()})
            if (config.save_every and step % config.save_every == 0) or step == steps:
                if runtime is not None:
                    runtime.synchronize()  # the host weights and states are written by copies in flight
                trainer_state = {"loss": loss_value, **(policy.state_dict(model) if policy is not None else {})}
                if dist is not None:
                    saved = save_sharded_checkpoint(out, step, model, optimizer, trainer_state, batches.state_dict(),
                                                    dist)
                else:
                    trainer_state["optimizer"] = optimizer.state_dict()
                    saved = save_checkpoint(out, step, model, trainer_state, batches.state_dict())
                last_saved = (saved, loss_value)
            if step == exit_after:
                os._exit(17)

    # The loop's last step always evaluates; a rerun of a finished run evaluates again.
    final = evaluate(step) if resumed_from == step else _last_eval_row(metrics_path, step)
    teacher = teacher_reference(reader, eval_idx, seq_len=config.seq_len)
    if main:
        atomic_write_json(out / "eval.json", {"step": step, "initial": initial.to_dict() if initial else None,
                                              "final": final.to_dict(), "teacher": teacher.to_dict(),
                                              "kl_note": kl_note(reader)})
    if runtime is not None:
        runtime.close()  # every copy done: the host weights are final
    if dist is not None:
        _save_gathered_student(model, out / "student", config.tokenizer, dist)
    else:
        save_student(model, out / "student", config.tokenizer)
    return TrainReport(str(out), str(out / "student"), step, resumed_from, loss_value, initial, final, teacher)


def _join_processes(config: TrainConfig):
    """Under torchrun with more than one process: check the config, join the process group and
    return this process's student.distributed.Dist; None for one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from student.distributed import check_config, setup, world_from_env

    dist = world_from_env()
    check_config(config, dist)
    setup(dist, config.device)
    return dist


def _save_gathered_student(model, folder: Path, tokenizer_dir: str, dist) -> None:
    """The final student of a sharded run: its full weights gathered to rank 0, which writes them."""
    import torch
    import torch.distributed as tdist

    from student.checkpoint import save_student
    from student.distributed import full_model_state
    from student.model import Student

    state = full_model_state(model)  # collective: every rank takes part
    if dist.main:
        with torch.device("meta"):  # no initialisation: the gathered weights are assigned
            plain = Student(model.config)
        plain.load_state_dict(state, assign=True)
        save_student(plain, folder, tokenizer_dir)
    tdist.barrier()


def steps_accumulate(config: TrainConfig) -> bool:
    """Whether a step's gradient sums several backwards (grad_accum > 1, or chunk-recurrent training):
    OffloadRuntime's `accumulates`; else its layers keep the matrices' gradients in the compute
    dtype. A chunked run accumulates even at one chunk (a batch's chunks are known as it runs)."""
    return config.grad_accum > 1 or config.long.chunk_tokens is not None


def _peak_gpu_bytes(device: str) -> dict:
    """{"peak_gpu_bytes": the most memory allocated on the GPU since the previous row, or since the
    training loop began, "peak_gpu_reserved_bytes": the most torch's caching allocator held from the
    device meanwhile} (then reset); {} on the CPU."""
    import torch

    if not device.startswith("cuda"):
        return {}
    peak = {"peak_gpu_bytes": torch.cuda.max_memory_allocated(device),
            "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def _diverged_message(step: int, loss: float, grad_norm: float, last_saved, kept: list[int]) -> str:
    if last_saved is None:
        where = "there is no checkpoint yet, so a rerun starts over"
    else:
        ckpt, ckpt_loss = last_saved
        loss_text = f", loss {ckpt_loss:.4g}" if ckpt_loss is not None else ""
        where = (f"the last checkpoint is {ckpt} (step {int(ckpt.name.removeprefix('step-'))}{loss_text}: the last "
                 "saved with a finite loss, which does not mean the weights are sound; the grad_norm rows of "
                 "metrics.jsonl show where it began to diverge)")
    older = f", or --resume-from STEP for an older kept checkpoint (kept: {', '.join(map(str, kept))})" if kept else ""
    return (f"loss {loss} / grad norm {grad_norm} is not finite at step {step}; stopped without saving; {where}. "
            f"Rerun with a lower --lr or more --warmup-steps (or --clip-grad) to continue from it{older}; "
            "metrics.jsonl records each change")


def _last_eval_row(path: Path, step: int):
    from student.evaluate import EvalResult

    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    row = [r for r in rows if r["kind"] == "eval" and r["step"] == step][-1]
    return EvalResult.from_dict(row)
