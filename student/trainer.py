"""Stage two: train a student against a teacher cache, in one readable loop.

Run directory (`out`):
  run.json            resolved config, cache id, student identity (a rerun must match it)
  metrics.jsonl       {"kind": "train", step, loss, kl, lr, grad_norm, tokens, tok_per_s,
                      optimizer_state_bytes}, with a ReLU-gated (sparse FFN) student also
                      l1 (mean over layers of sum over d_ff of |h|, mean over tokens) and, per layer
                      over the steps since the previous row, ffn_nnz (mean non-zeros of h per token),
                      ffn_sparsity (1 - nnz / d_ff), ffn_dead (share of neurons zero on every token;
                      counted over the real tokens of the batches, padding left out),
                      ffn_overflow_rows / ffn_fallback_rows (kernel counts), ffn_reinit (gate
                      rows moved by dead_reinit); and
                      {"kind": "eval", step, kl, ce, ppl, top1, tokens (+ ffn_nnz, ffn_sparsity,
                      ffn_dead for a sparse student)} rows
  initial_eval.json   the step-0 student on the evaluation sequences
  eval.json           initial / final student and teacher reference at the end
  checkpoints/step-NNNNNN/  model/ (HF folder), trainer_state.pt, data.json (last two kept)
  student/            the final student: HF folder with the tokenizer's files

Rerunning `train` with the same config resumes from the last checkpoint; with deterministic=True
on the CPU the losses equal those of an uninterrupted run bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kernels.fused_topk_kl import TAIL_MODES, fused_topk_kl
from student.data import CacheBatches, Prefetcher, split_indices
from student.evaluate import EvalResult, evaluate_student, teacher_reference
from student.model import Student, to_relu_gate
from student.optim import state_bytes
from student.optim.clip import clip_grad_norm_foreach
from distill.devices import resolve_device, resolve_dtype
from distill.errors import DistillUserError
from distill.files import atomic_write_json
from teacher_cache.identity import tokenizer_info
from teacher_cache.reader import CacheReader

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")
KEEP_CHECKPOINTS = 2
OPTIMIZERS = ("adamw", "foam", "adamw8bit")
BETAS = (0.9, 0.95)
# Fields that change how often things are logged or saved, not what is trained: a rerun may change them.
_NON_IDENTITY_FIELDS = ("out", "eval_every", "eval_sequences", "save_every", "log_every")
_TEST_EXIT_ENV = "DISTILL_TEST_EXIT_AFTER_STEP"  # tests only: os._exit after this step, as a kill would
logger = logging.getLogger(__name__)


class RunDirError(DistillUserError):
    """The run directory holds another run, or a checkpoint of another model."""


class NonFiniteLossError(DistillUserError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class TrainConfig:
    """Stage two. Give `student` (an HF folder) or `teacher` + `num_layers` (prune the teacher)."""

    cache: str  # teacher cache directory (read only; several runs may share it)
    out: str  # run directory; rerunning with the same config resumes from its last checkpoint
    student: str | None = None  # HF folder of the initial student
    teacher: str | None = None  # HF folder of the teacher, pruned to `num_layers` layers as the initial student
    num_layers: int | None = None  # layers kept from the teacher (evenly spaced, first and last included)
    tokenizer: str | None = None  # folder with the tokenizer files (default: the student/teacher folder)
    steps: int = 1000  # optimizer steps
    batch_size: int = 8  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seq_len: int | None = None  # crop sequences to this many positions (None: as cached)
    lr: float = 3e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 50  # linear warmup steps
    weight_decay: float = 0.1  # AdamW decay on matrices (not on norms, biases)
    clip_grad: float = 1.0  # max global gradient norm (0: no clipping)
    optimizer: str = "adamw"  # "adamw" | "foam" (block-folded states) | "adamw8bit" (block-wise 8-bit states)
    foam_level: int = 2  # FOAM: moments folded into blocks of 2**foam_level along each matrix's last dim
    foam_scale: float = 0.25  # FOAM: the update scale alpha of folded matrices (the authors' default)
    foam_fold_embeddings: bool = False  # FOAM: fold the embedding / lm-head too (else plain Adam)
    # "bucket" | "renorm" | "unnormalized": see kernels/fused_topk_kl.py. "bucket" is the default because
    # "renorm" never moves the student's mass into the teacher's top-k: in a 40-step run on the real
    # SmolLM2 cache, held-out KL went 10.26 -> 2.29 with bucket, 5.64 with renorm, 2.87 CE-only.
    tail: str = "bucket"
    temperature: float = 1.0  # training temperature applied to the cached targets
    ce_weight: float = 0.0  # weight of next-token cross-entropy; 1.0 is the CE-only baseline
    heldout: int = 8  # evenly spaced sequences kept out of training for evaluation
    eval_every: int = 200  # evaluate every this many steps (0: only at the start and the end)
    eval_sequences: int | None = None  # held-out sequences each evaluation uses (None: all)
    save_every: int = 200  # checkpoint every this many steps (and at the end)
    log_every: int = 10  # metrics row every this many steps
    device: str = "auto"  # "auto" (cuda if available) | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # autocast dtype: "auto" (bfloat16 on GPU, float32 on CPU) | "float32" | "bfloat16"
    seed: int = 0  # data order and crops
    deterministic: bool = False  # torch deterministic algorithms (exact resume on the CPU needs it)
    # Sparse FFN (TwELL): a SwiGLU student gets the ReLU gate (same weights), and the loss adds
    # l1 * mean over layers of (sum over d_ff of |h|, mean over tokens), the authors' code normalisation.
    sparse_ffn: bool = False
    l1: float = 2e-5  # L1 coefficient of the sparse FFN (used only with sparse_ffn); the paper's conservative value
    # How a ReLU-gated FFN computes: "dense" (three matmuls) or "twell": at each logging step,
    # layers whose mean non-zeros per token fell under TWELL_MAX_NNZ switch to
    # kernels/twell_ffn.py's sparse Triton kernels on a GPU (a fifth of the activation memory;
    # on the H200 at d=2048, dff=5632 about level with dense at 56 non-zeros, 1.3-1.4x faster at
    # 28, 1.4-1.6x at 18-27 on a trained student's own activations, slower above 56, RESULTS.md),
    # the others stay dense; metrics rows record each layer's choice as ffn_kernel. Dense stays the
    # default: through the trainer (4K tokens a step) twell ran at 0.65-0.75x dense's tokens/s at
    # the 135M shape and 0.72-0.84x at d=2048, dff=5632; the kernels pay only from about 16K tokens
    # a call (batch_size x seq_len), at 99.5% (RESULTS.md).
    sparse_kernel: str = "dense"
    # Dead-neuron mitigation of the paper's App. C.3: the paper calls a neuron dead when it fires on
    # no token of a ~1M-token step, and after each such step moves its gate row to
    # (1 - r) w + r N(0, 0.02^2), r = 0.1. Here the judgement covers windows of whole steps holding
    # at least dead_window tokens (real, not padding): after the step that closes a window, the
    # neurons silent over all of it move. Steps of 4K tokens each would find ~40% of a 99%-sparse
    # layer silent by chance (RESULTS.md). dead_reinit = 0 turns it off.
    dead_reinit: float = 0.0
    dead_window: int = 1_000_000

    def __post_init__(self):
        if (self.student is None) == (self.teacher is None):
            raise DistillUserError("give exactly one of `student` (an HF folder) or `teacher` + `num_layers`, "
                                   f"got student={self.student!r}, teacher={self.teacher!r}")
        if self.teacher is not None and self.num_layers is None:
            raise DistillUserError("`num_layers` is required with `teacher` (how many layers the student keeps)")
        for name in ("steps", "batch_size", "grad_accum"):
            _check(name, getattr(self, name), lambda v: isinstance(v, int) and v >= 1, "an int >= 1")
        for name in ("warmup_steps", "heldout", "eval_every", "save_every", "log_every", "seed"):
            _check(name, getattr(self, name), lambda v: isinstance(v, int) and v >= 0, "an int >= 0")
        _check("seq_len", self.seq_len, lambda v: v is None or (isinstance(v, int) and v >= 2), "None or an int >= 2")
        _check("eval_sequences", self.eval_sequences, lambda v: v is None or (isinstance(v, int) and v >= 1),
               "None or an int >= 1")
        _check("lr", self.lr, lambda v: v > 0, "> 0")
        _check("min_lr_ratio", self.min_lr_ratio, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check("weight_decay", self.weight_decay, lambda v: v >= 0, ">= 0")
        _check("clip_grad", self.clip_grad, lambda v: v >= 0, ">= 0 (0: no clipping)")
        _check("tail", self.tail, lambda v: v in TAIL_MODES, f"one of {TAIL_MODES}")
        _check("temperature", self.temperature, lambda v: v > 0, "> 0")
        _check("ce_weight", self.ce_weight, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check("optimizer", self.optimizer, lambda v: v in OPTIMIZERS, f"one of {OPTIMIZERS}")
        _check("foam_level", self.foam_level, lambda v: isinstance(v, int) and 0 <= v <= 12, "an int in [0, 12]")
        _check("foam_scale", self.foam_scale, lambda v: v > 0, "> 0")
        _check("sparse_kernel", self.sparse_kernel, lambda v: v in ("dense", "twell"), "'dense' or 'twell'")
        _check("l1", self.l1, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
               "a number >= 0")
        _check("dead_reinit", self.dead_reinit, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
               and 0 <= v <= 1, "a number in [0, 1]")
        _check("dead_window", self.dead_window, lambda v: isinstance(v, int) and v >= 1, "an int >= 1 (tokens)")
        if self.dead_reinit and not self.sparse_ffn:
            raise DistillUserError("`dead_reinit` acts on the sparse FFN's gate: add sparse_ffn (--sparse-ffn) or drop it")
        _check("dtype", self.dtype, lambda v: v in ("auto", "float32", "bfloat16"), "'auto', 'float32' or 'bfloat16'")
        if self.heldout == 0:
            raise DistillUserError("`heldout` must be >= 1: evaluation needs held-out sequences")


def _check(name, value, ok, allowed):
    if not ok(value):
        raise DistillUserError(f"`{name}` must be {allowed}, got {value!r}")


@dataclass
class TrainReport:
    run_dir: str
    student_dir: str
    steps: int  # steps done in total
    resumed_from: int  # step of the checkpoint this call started from (0: fresh)
    final_loss: float | None  # loss of the last step this call ran (None if it ran none)
    initial_eval: EvalResult | None
    final_eval: EvalResult
    teacher_eval: EvalResult


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of `lr` at 0-based optimizer step `step`: linear warmup, then cosine to min_lr_ratio."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


# --- setup --------------------------------------------------------------------------------------


def _resolve(config: TrainConfig) -> TrainConfig:
    absolute = lambda p: None if p is None else str(Path(p).expanduser().resolve())
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    return dataclasses.replace(
        config, cache=absolute(config.cache), out=absolute(config.out), student=absolute(config.student),
        teacher=absolute(config.teacher), tokenizer=absolute(config.tokenizer or config.student or config.teacher),
        device=device, dtype=dtype)


def _load_tokenizer_info(folder: str) -> dict:
    from transformers import AutoTokenizer

    try:
        return tokenizer_info(AutoTokenizer.from_pretrained(folder))
    except (OSError, ValueError) as e:
        raise DistillUserError(f"cannot load a tokenizer from {folder} ({type(e).__name__}); pass `tokenizer`, "
                               "a folder with tokenizer.json / tokenizer_config.json") from None


def _initial_student(config: TrainConfig) -> tuple[Student, dict]:
    if config.student is not None and not any(Path(config.student).glob("*.safetensors")):
        # A folder with only config.json: a student of that shape, randomly initialised (seeded).
        from student.config import StudentConfig

        cfg = StudentConfig.from_hf_dict(json.loads((Path(config.student) / "config.json").read_text()))
        model, init = Student(cfg).to(config.device), f"config:{config.student}"
    elif config.student is not None:
        model, init = Student.from_pretrained(config.student, device=config.device), f"student:{config.student}"
    else:
        model = Student.from_teacher_pruned(config.teacher, config.num_layers, device=config.device)
        init = f"teacher:{config.teacher}:num_layers={config.num_layers}"
    if config.sparse_ffn and not model.config.sparse_ffn:
        to_relu_gate(model)
        logger.info("sparse_ffn: the SwiGLU student (%s) now has a ReLU gate, same weights; L1 coefficient %g",
                    init, config.l1)
        init += ":relu-gate"
    elif model.config.sparse_ffn and not config.sparse_ffn:
        logger.info("the student has a ReLU-gated FFN but sparse_ffn is off: training it without the L1 penalty")
    for layer in model.layers:  # dense until the first logging step measures the layers' sparsity
        layer.mlp.impl = "torch"
    return model, {"init": init, "config": model.config.to_hf_dict()}


def _check_run_dir(out: Path, run: dict) -> None:
    """Write run.json in a new run dir; in an existing one, refuse a different run."""
    path = out / "run.json"
    if not path.exists():
        if out.exists() and any(out.iterdir()):
            raise RunDirError(f"{out} is not empty and holds no run.json; give `out` a new or empty directory")
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, run)
        return
    old = json.loads(path.read_text())
    # a field added after the run was written reads as its default
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
    was = lambda k: old["config"].get(k, defaults.get(k))
    diffs = [f"{k}: {was(k)!r} -> {v!r}" for k, v in run["config"].items()
             if k not in _NON_IDENTITY_FIELDS and was(k) != v]
    diffs += [f"{k}" for k in ("cache_id", "student", "tokenizer_hash") if old.get(k) != run.get(k)]
    if diffs:
        raise RunDirError(f"{out} holds another run (run.json differs in {'; '.join(diffs)}); use a new `out`, "
                          "or rerun with the same settings to resume it")


def _optimizer(model, config: TrainConfig):
    """AdamW, FOAM or 8-bit AdamW; weight decay on matrices only, the same betas for all three."""
    if config.optimizer == "foam":
        from student.optim.foam import FOAM, foam_param_groups

        groups = foam_param_groups(model, weight_decay=config.weight_decay, level=config.foam_level,
                                   scale=config.foam_scale, fold_embeddings=config.foam_fold_embeddings)
        return FOAM(groups, lr=config.lr, betas=BETAS, eps=1e-8)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if config.optimizer == "adamw8bit":
        from student.optim.adam8bit import AdamW8bit

        return AdamW8bit(groups, lr=config.lr, betas=BETAS, eps=1e-8)
    fused = {"fused": True} if config.device.startswith("cuda") else {}
    return torch.optim.AdamW(groups, lr=config.lr, betas=BETAS, eps=1e-8, **fused)


# --- checkpoints --------------------------------------------------------------------------------


def latest_checkpoint(out) -> Path | None:
    found = sorted((Path(out) / "checkpoints").glob("step-[0-9]*"))
    return found[-1] if found else None


def _rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_checkpoint(out: Path, step: int, model, optimizer, scheduler, data: Prefetcher,
                     ffn_window: FFNWindow | None) -> Path:
    final = out / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "model")
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": _rng_state(), "ffn_window": ffn_window.state_dict() if ffn_window else None,
                "ffn_impl": [layer.mlp.impl for layer in model.layers]},
               tmp / "trainer_state.pt")
    atomic_write_json(tmp / "data.json", data.state_dict())
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted((out / "checkpoints").glob("step-[0-9]*"))[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old)
    return final


def _load_checkpoint(ckpt: Path, model, optimizer, scheduler, data: CacheBatches,
                     ffn_window: FFNWindow | None) -> int:
    saved = json.loads((ckpt / "model" / "config.json").read_text())
    ours = model.config.to_hf_dict(saved.get("dtype", "float32"))
    diffs = [f"{k}: {saved.get(k)!r} (checkpoint) vs {v!r}" for k, v in ours.items() if saved.get(k) != v]
    if diffs:
        raise RunDirError(f"checkpoint {ckpt} is of another model ({'; '.join(diffs[:4])}); use a new `out` "
                          "or remove that checkpoint")
    weights = Student.from_pretrained(ckpt / "model", device=model.embed_tokens.weight.device)
    model.load_state_dict(weights.state_dict())
    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    data.load_state_dict(json.loads((ckpt / "data.json").read_text()))
    _set_rng_state(state["rng"])
    if ffn_window is not None and state.get("ffn_window") is not None:
        ffn_window.load_state_dict(state["ffn_window"])
    for layer, impl in zip(model.layers, state.get("ffn_impl") or []):
        layer.mlp.impl = impl
    return int(state["step"])


def _rewind_metrics(path: Path, step: int) -> None:
    """Keep only the rows up to checkpoint `step` (0: none), as a resumed run rewrites what follows."""
    lines = path.read_text().splitlines() if path.exists() and step > 0 else []
    rows = [line for line in lines if _row_step(line) <= step]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(r + "\n" for r in rows))
    tmp.replace(path)


def _row_step(line: str) -> float:
    """A row's step; a line cut short by a kill counts as after every checkpoint (dropped)."""
    try:
        return json.loads(line)["step"]
    except json.JSONDecodeError:
        return math.inf


def _save_student(model, folder: Path, tokenizer_dir: str) -> None:
    """The final student as an HF folder with the tokenizer's files, renamed into place whole."""
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


# --- sparse FFN statistics ----------------------------------------------------------------------


class FFNWindow:
    """Per-layer statistics of a ReLU-gated student summed on its device over the micro-batches
    since the last metrics row; only `row` copies them to the host (at logging steps)."""

    def __init__(self, num_layers: int, d_ff: int, device):
        self.d_ff = d_ff
        self.l1_step = torch.zeros((), device=device)  # sum over this step's micro-batches of the mean-layer l1
        self.nnz_L = torch.zeros(num_layers, device=device)  # sum over calls of mean non-zeros per token
        self.active_LF = torch.zeros(num_layers, d_ff, dtype=torch.bool, device=device)
        self.overflow_L = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.fallback_L = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.reinit_L = torch.zeros(num_layers, dtype=torch.int64, device=device)  # gate rows moved (dead_reinit)
        self.calls = 0
        self.l1_last = torch.zeros((), device=device)  # mean over the last step's micro-batches
        # Neurons active since the current dead window (TrainConfig.dead_window) began, and its tokens.
        self.dead_active_LF = torch.zeros(num_layers, d_ff, dtype=torch.bool, device=device)
        self.dead_tokens = 0

    def add(self, terms: list) -> None:
        """terms: per layer (l1, FFNStats) of one micro-batch (Student.ffn_terms())."""
        self.l1_step += torch.stack([l1.detach() for l1, _ in terms]).mean()
        self.nnz_L += torch.stack([s.nnz for _, s in terms]).to(self.nnz_L)
        active_LF = torch.stack([s.active for _, s in terms])
        self.active_LF |= active_LF
        self.dead_active_LF |= active_LF
        self.overflow_L += torch.stack([s.overflow_rows for _, s in terms])
        self.fallback_L += torch.stack([s.fallback_rows for _, s in terms])
        self.calls += 1

    def end_step(self, grad_accum: int, tokens: int, dead_window: int) -> torch.Tensor | None:
        """Close the step of `tokens` real tokens. When that closes a dead window (at least
        `dead_window` tokens since it began), returns the neurons active over the window (bool
        [L, d_ff]) and starts the next; else None."""
        self.l1_last = self.l1_step / grad_accum
        self.l1_step = torch.zeros_like(self.l1_step)
        self.dead_tokens += tokens
        if self.dead_tokens < dead_window:
            return None
        active, self.dead_active_LF = self.dead_active_LF, torch.zeros_like(self.dead_active_LF)
        self.dead_tokens = 0
        return active

    def row(self) -> dict:
        """The metrics of the window (one host sync), then start a new one."""
        nnz = (self.nnz_L / max(self.calls, 1)).tolist()
        out = {"l1": self.l1_last.item(), "ffn_nnz": nnz, "ffn_sparsity": [1 - n / self.d_ff for n in nnz],
               "ffn_dead": (1 - self.active_LF.float().mean(1)).tolist(),
               "ffn_overflow_rows": self.overflow_L.tolist(), "ffn_fallback_rows": self.fallback_L.tolist(),
               "ffn_reinit": self.reinit_L.tolist()}
        self.nnz_L.zero_(), self.active_LF.zero_(), self.overflow_L.zero_(), self.fallback_L.zero_()
        self.reinit_L.zero_()
        self.calls = 0
        return out

    def state_dict(self) -> dict:
        return {"nnz_L": self.nnz_L.cpu(), "active_LF": self.active_LF.cpu(), "overflow_L": self.overflow_L.cpu(),
                "fallback_L": self.fallback_L.cpu(), "reinit_L": self.reinit_L.cpu(), "calls": self.calls,
                "dead_active_LF": self.dead_active_LF.cpu(), "dead_tokens": self.dead_tokens}

    def load_state_dict(self, state: dict) -> None:
        for name in ("nnz_L", "active_LF", "overflow_L", "fallback_L", "reinit_L", "dead_active_LF"):
            if name in state:  # checkpoints written before dead_reinit / dead_window lack the last two
                getattr(self, name).copy_(state[name])
        self.calls = state["calls"]
        self.dead_tokens = state.get("dead_tokens", 0)


# The authors route a layer to their sparse kernels once its mean non-zeros per token fall under 50
# (`sparsity_l0_cutoff` in SakanaAI/sparser-faster-llms' configs; at d_ff = 5632, 99.1% sparse).
# Our kernels break even with dense near there at that d_ff (56 non-zeros, RESULTS.md); each
# non-zero costs a fixed gather, so for other widths the break-even is about 1% of d_ff.
TWELL_MAX_NNZ = 50


def _ffn_metrics(model: Student, ffn_window: FFNWindow | None, config: TrainConfig) -> dict:
    """The window's FFN metrics (none for a dense student); with sparse_kernel "twell", also route
    each layer by its measured non-zeros (sparse kernels under TWELL_MAX_NNZ, dense otherwise)."""
    if ffn_window is None:
        return {}
    row = ffn_window.row()
    if config.sparse_kernel == "twell":
        for layer, nnz in zip(model.layers, row["ffn_nnz"]):
            layer.mlp.impl = "auto" if nnz < TWELL_MAX_NNZ else "torch"
        row["ffn_kernel"] = ["twell" if layer.mlp.impl == "auto" else "dense" for layer in model.layers]
    return row


# App. C.3 of the paper: the noise the gate rows of dead neurons are pulled toward.
DEAD_REINIT_STD = 0.02


def _reinit_dead_gates(model: Student, active_LF: torch.Tensor, rate: float, seed: int, step: int) -> torch.Tensor:
    """Gate rows of the neurons inactive over the dead window (~active_LF) <- (1 - rate) w + rate N(0, 0.02^2),
    the noise from a generator seeded by (seed, step), so a resumed run draws the same. Returns the
    number moved per layer (int64 [L], on the device; no host sync)."""
    gen = torch.Generator(device=active_LF.device).manual_seed(seed * 1_000_003 + step)
    with torch.no_grad():
        for layer, active_F in zip(model.layers, active_LF):
            w = layer.mlp.gate_proj.weight
            noise = torch.randn(w.shape, generator=gen, device=w.device, dtype=torch.float32) * DEAD_REINIT_STD
            moved = (1 - rate) * w.float() + rate * noise
            w.copy_(torch.where(active_F[:, None], w.float(), moved).to(w.dtype))
    return (~active_LF).sum(dim=1)


def _l1_penalty(model: Student) -> torch.Tensor:
    """Mean over layers of the latest forward's per-layer l1 (sum over d_ff of |h|, mean over tokens)."""
    return torch.stack([l1 for l1, _ in model.ffn_terms()]).mean()


# --- the loop -----------------------------------------------------------------------------------


def _step_loss(model, batch, config: TrainConfig, amp):
    """(loss to backpropagate, KL at the training temperature) of one micro-batch; with sparse_ffn the
    loss adds l1 * the mean per-layer L1 of the FFN activations."""
    with amp:
        hidden = model(batch.input_ids, token_mask=batch.mask)
    loss, kl = _distill_loss(model, hidden, batch, config)
    if config.sparse_ffn:
        loss = loss + config.l1 * _l1_penalty(model)
    return loss, kl


def _distill_loss(model, hidden, batch, config: TrainConfig):
    """(KD / CE loss, KL at the training temperature) from the final hidden states."""
    hidden_ND = hidden.reshape(-1, hidden.shape[-1])
    if config.dtype == "bfloat16":  # the final norm returns fp32 under autocast; the lm-head matmuls run in bf16
        hidden_ND = hidden_ND.to(torch.bfloat16)
    weight = model.lm_head_weight.to(hidden_ND.dtype)
    args = (hidden_ND, weight, batch.topk_ids, batch.topk_logprobs, batch.tail_logmass)
    kw = dict(target_ids=batch.target_ids, mask=batch.mask, tail=config.tail, temperature=config.temperature,
              impl="auto", check_ids=not config.device.startswith("cuda"))
    # One call: the loss mixes CE in when 0 < ce_weight, and the KL term comes back beside it for
    # the metrics (with ce_weight = 1 the kernel takes it from a forward-only pass).
    loss, kl = fused_topk_kl(*args, **kw, ce_weight=config.ce_weight, return_kl=True)
    return loss, kl


def train(config: TrainConfig, progress: bool = True) -> TrainReport:
    """Train (or resume) the run described by `config`; returns what it did and the final evaluation."""
    config = _resolve(config)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        return _train(config, progress)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _train(config: TrainConfig, progress: bool) -> TrainReport:
    from tqdm.auto import tqdm

    out, device = Path(config.out), config.device
    random.seed(config.seed), np.random.seed(config.seed), torch.manual_seed(config.seed)

    tok = _load_tokenizer_info(config.tokenizer)
    reader = CacheReader(config.cache, expect_vocab_size=tok["vocab_size"], expect_tokenizer_hash=tok["hash"])
    model, identity = _initial_student(config)
    if model.config.vocab_size < tok["vocab_size"]:
        raise DistillUserError(f"the student's vocab size {model.config.vocab_size} is smaller than its "
                               f"tokenizer's {tok['vocab_size']}; use a student built for this tokenizer")
    run = {"config": dataclasses.asdict(config), "cache_id": reader.manifest.cache_id, "student": identity,
           "tokenizer_hash": tok["hash"]}
    _check_run_dir(out, run)

    train_idx, held_idx = split_indices(reader.num_sequences, config.heldout)
    eval_idx = held_idx[:config.eval_sequences] if config.eval_sequences else held_idx
    amp_dtype = torch.bfloat16 if config.dtype == "bfloat16" else None
    amp = torch.autocast(torch.device(device).type, dtype=amp_dtype) if amp_dtype else nullcontext()
    evaluate = lambda: evaluate_student(model, reader, eval_idx, batch_size=config.batch_size, device=device,
                                        seq_len=config.seq_len, autocast_dtype=amp_dtype)

    optimizer = _optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    # Its own reader: batches are built on a background thread while evaluation reads through `reader`.
    data = CacheBatches(CacheReader(config.cache), train_idx, config.batch_size, seq_len=config.seq_len,
                        seed=config.seed, pin_memory=device.startswith("cuda"))
    metrics_path = out / "metrics.jsonl"
    for leftover in [*out.glob(".student.tmp-*"), *(out / "checkpoints").glob(".tmp-step-*")]:
        shutil.rmtree(leftover)  # from a run killed while writing; the renamed copies are whole
    ffn_window = (FFNWindow(model.config.num_layers, model.config.intermediate_size, device)
                  if model.config.sparse_ffn else None)
    ckpt = latest_checkpoint(out)
    step = _load_checkpoint(ckpt, model, optimizer, scheduler, data, ffn_window) if ckpt else 0
    resumed_from = step
    _rewind_metrics(metrics_path, step)
    metrics = metrics_path.open("a")
    log = lambda row: (metrics.write(json.dumps(row) + "\n"), metrics.flush())

    initial = None
    if step == 0:
        initial = evaluate()
        atomic_write_json(out / "initial_eval.json", initial.to_dict())
        log({"kind": "eval", "step": 0, **initial.to_dict()})
    elif (out / "initial_eval.json").exists():
        initial = EvalResult.from_dict(json.loads((out / "initial_eval.json").read_text()))

    model.train()
    batches = Prefetcher(data)
    exit_after = int(os.environ.get(_TEST_EXIT_ENV, "-1"))
    loss_value, window_tokens, window_start = None, 0, time.perf_counter()
    bar = tqdm(total=config.steps, initial=step, disable=not progress, desc="train", unit="step")
    with bar, metrics, batches:
        while step < config.steps:
            loss_sum, kl_sum, tokens = 0.0, 0.0, 0
            for _ in range(config.grad_accum):
                batch = next(batches).to(device, non_blocking=True)
                loss, kl = _step_loss(model, batch, config, amp)
                if ffn_window is not None:
                    ffn_window.add(model.ffn_terms())
                (loss / config.grad_accum).backward()
                loss_sum, kl_sum, tokens = loss_sum + loss.item(), kl_sum + kl.item(), tokens + batch.num_tokens
            window_active = (ffn_window.end_step(config.grad_accum, tokens, config.dead_window)
                             if ffn_window is not None else None)
            max_norm = config.clip_grad if config.clip_grad > 0 else float("inf")
            grad_norm = clip_grad_norm_foreach(model.parameters(), max_norm).item()
            loss_value = loss_sum / config.grad_accum
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                last = latest_checkpoint(out)
                raise NonFiniteLossError(
                    f"loss {loss_value} / grad norm {grad_norm} is not finite at step {step + 1}; stopped without "
                    f"saving; the last good checkpoint is {last or 'none (no checkpoint yet)'}: lower `lr` or raise "
                    "`warmup_steps`, then rerun to resume from it")
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if config.dead_reinit and window_active is not None:
                ffn_window.reinit_L += _reinit_dead_gates(model, window_active, config.dead_reinit, config.seed, step)
            window_tokens += tokens
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}")
            if step % config.log_every == 0 or step == config.steps:
                elapsed = time.perf_counter() - window_start
                log({"kind": "train", "step": step, "loss": loss_value, "kl": kl_sum / config.grad_accum, "lr": lr,
                     "grad_norm": grad_norm, "tokens": tokens, "tok_per_s": window_tokens / max(elapsed, 1e-9),
                     "optimizer_state_bytes": state_bytes(optimizer),
                     "epoch": batches.epoch, **_ffn_metrics(model, ffn_window, config)})
                window_tokens, window_start = 0, time.perf_counter()
            if (config.eval_every and step % config.eval_every == 0) or step == config.steps:
                log({"kind": "eval", "step": step, **evaluate().to_dict()})
            if (config.save_every and step % config.save_every == 0) or step == config.steps:
                _save_checkpoint(out, step, model, optimizer, scheduler, batches, ffn_window)
            if step == exit_after:
                os._exit(17)

    # The loop's last step always evaluates; a rerun of a finished run evaluates again.
    final = evaluate() if resumed_from == step else _last_eval_row(metrics_path, step)
    teacher = teacher_reference(reader, eval_idx, seq_len=config.seq_len)
    atomic_write_json(out / "eval.json", {"step": step, "initial": initial.to_dict() if initial else None,
                                    "final": final.to_dict(), "teacher": teacher.to_dict()})
    _save_student(model, out / "student", config.tokenizer)
    return TrainReport(str(out), str(out / "student"), step, resumed_from, loss_value, initial, final, teacher)


def _last_eval_row(path: Path, step: int) -> EvalResult:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    row = [r for r in rows if r["kind"] == "eval" and r["step"] == step][-1]
    return EvalResult.from_dict(row)
