"""One training step's parts, public: shared by the loop (student/trainer.py), the planner's profile
(student/planner/profile.py) and the tests, so the code that plans a step never imports the loop.

  resolve                the config with paths absolute and "auto" device/dtype resolved
  initial_student        the model a run starts from, and its identity for run.json
  micro_batch_loss       (loss, KL) of a micro-batch's (or a chunk's) final hidden states
  micro_batch_backward   forward and backward of one micro-batch, whole or chunk by chunk
  steps_accumulate       whether a step's gradient sums several backwards
  peak_gpu_bytes         the GPU memory peaks since the last reading (then reset)
  NoPolicy               the model policy of a dense student (the sparse FFN's is SparseFFNPolicy)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from distill.devices import resolve_device, resolve_dtype
from student.config import StudentConfig
from student.long_context.engine import Part, chunk_recurrent_backward
from student.loss import distill_loss
from student.model import Student, to_relu_gate
from student.sparse_ffn import SparseFFNPolicy
from student.train_config import TrainConfig
from student.transplant import fit_vocabulary
from teacher_cache.location import absolute_cache

__all__ = ["NoPolicy", "autocast_dtype", "initial_student", "micro_batch_backward", "micro_batch_loss", "model_policy",
           "peak_gpu_bytes", "resolve", "steps_accumulate"]

logger = logging.getLogger(__name__)


def resolve(config: TrainConfig) -> TrainConfig:
    """Absolute paths (a cache URL as given), the device and dtype "auto" resolved, and the warmup as a
    number of steps."""
    absolute = lambda p: None if p is None else str(Path(p).expanduser().resolve())
    device = resolve_device(config.device)
    offload = config.offload.offload
    return config.with_flat(
        offload=offload if offload in ("none", "auto") else absolute(offload),
        cache=tuple(map(absolute_cache, config.cache)), ensemble=tuple(map(absolute_cache, config.ensemble)),
        out=absolute(config.out), student=absolute(config.student),
        teacher=absolute(config.teacher), tokenizer=absolute(config.tokenizer or config.student or config.teacher),
        device=device, dtype=resolve_dtype(config.dtype, device), warmup_steps=config.schedule.warmup)


def initial_student(config: TrainConfig, device: str) -> tuple[Student, dict]:
    """(model on `device`, identity for run.json): from an HF folder, from a folder with only a
    config.json (randomly initialised, seeded), or pruned from the teacher (with the embedding and
    lm-head of another tokenizer when `tokenizer` is not the teacher's: student/transplant.py); with
    sparse_ffn a SwiGLU student gets a ReLU gate (same weights)."""
    if config.student is not None and not any(Path(config.student).glob("*.safetensors")):
        cfg = StudentConfig.from_hf_dict(json.loads((Path(config.student) / "config.json").read_text()))
        model, init = Student(cfg).to(device), f"config:{config.student}"
    elif config.student is not None:
        model, init = Student.from_pretrained(config.student, device=device), f"student:{config.student}"
    else:
        model = Student.from_teacher_pruned(config.teacher, config.num_layers, device=device)
        init = f"teacher:{config.teacher}:num_layers={config.num_layers}"
        init += fit_vocabulary(model, config.teacher, config.tokenizer, config.embedding_init)
    if config.sparse.sparse_ffn and not model.config.sparse_ffn:
        to_relu_gate(model)
        logger.info("sparse_ffn: the SwiGLU student (%s) now has a ReLU gate, same weights; L1 coefficient %g",
                    init, config.sparse.l1)
        init += ":relu-gate"
    elif model.config.sparse_ffn and not config.sparse.sparse_ffn:
        logger.info("the student has a ReLU-gated FFN but sparse_ffn is off: training it without the L1 penalty")
    return model, {"init": init, "config": model.config.to_hf_dict()}


class NoPolicy:
    """The model policy of a dense student: no penalty, no measurements, no state. The loop calls a
    policy's hooks every step; SparseFFNPolicy (student/sparse_ffn.py) is the other one."""

    def observe(self, terms, share: float = 1.0) -> None:
        pass

    def penalty(self, terms):
        return None

    def end_step(self, model, step: int, grad_accum: int, tokens: int) -> None:
        pass

    def metrics(self, model) -> dict:
        return {}

    def state_dict(self, model) -> dict:
        return {}

    def load_state_dict(self, state: dict, model) -> None:
        pass


def model_policy(config: TrainConfig, model, reduce=None) -> SparseFFNPolicy | NoPolicy:
    """The policy a run's model trains under: the sparse FFN's for a ReLU-gated student (reduce: the
    sum over ranks of its counts under torchrun), else NoPolicy."""
    if not model.config.sparse_ffn:
        return NoPolicy()
    return SparseFFNPolicy(config.sparse, model, config.device, config.seed, reduce=reduce)


def micro_batch_loss(hidden, terms, rows, model, config: TrainConfig, *, cache_temperature: float,
                     policy=None, part: Part | None = None):
    """(loss to backpropagate, KL at the distillation temperature) of the final hidden states
    [B, T, d] of `rows`: a micro-batch, or a chunk of one (`part`: the chunks' losses then sum to the
    micro-batch's); the model `policy` (NoPolicy or the sparse FFN's) sees the FFN's measurements and
    may add a penalty."""
    hidden_ND = hidden.reshape(-1, hidden.shape[-1])
    if config.dtype == "bfloat16":  # the final norm returns fp32 under autocast; the lm-head matmuls run in bf16
        hidden_ND = hidden_ND.to(torch.bfloat16)
    # One call: the loss mixes CE in when 0 < ce_weight, and the KL term comes back beside it for the metrics.
    loss, kl = distill_loss(hidden_ND, model.lm_head_weight.to(hidden_ND.dtype), rows, config.loss,
                            cache_temperature=cache_temperature, check_ids=not config.device.startswith("cuda"),
                            whole=part.whole if part is not None else None)
    share = part.share if part is not None else 1.0
    policy = policy if policy is not None else NoPolicy()
    policy.observe(terms, share)
    penalty = policy.penalty(terms)
    if penalty is not None:
        loss = loss + penalty * share
    return loss, kl


def micro_batch_backward(model, batch, config: TrainConfig, amp_dtype, *, cache_temperature: float, policy=None,
                         whole: tuple[int, int] | None = None):
    """Forward and backward of one micro-batch (host memory) scaled by 1 / grad_accum, whole or
    chunk by chunk (the long-context engine); returns its (loss, KL), detached. whole: the (real
    rows, rows with a next token) of the micro-batch over all ranks when `batch` is this rank's
    part of it (student/distributed.py): the loss is then the part's share of the micro-batch's."""
    grad_scale = 1.0 / config.grad_accum
    loss_of = lambda hidden, terms, rows, part=None: micro_batch_loss(
        hidden, terms, rows, model, config, policy=policy, cache_temperature=cache_temperature, part=part)
    if config.long.chunk_tokens is not None:
        chunk_loss = lambda hidden, rows, terms, part: loss_of(hidden, terms, rows, part)
        return chunk_recurrent_backward(model, batch, chunk_loss, config.long, device=config.device,
                                        autocast_dtype=amp_dtype, grad_scale=grad_scale, whole=whole)
    part = None if whole is None else Part(*whole, share=int(batch.kd_rows.sum()) / max(whole[0], 1))
    batch = batch.to(config.device, non_blocking=True)
    with torch.autocast(torch.device(config.device).type, dtype=amp_dtype, enabled=amp_dtype is not None):
        hidden, terms = model(batch.input_ids, token_mask=batch.mask, return_ffn_terms=True)
    loss, kl = loss_of(hidden, terms, batch, part)
    (loss * grad_scale).backward()
    return loss.detach(), kl.detach()


def autocast_dtype(config: TrainConfig) -> torch.dtype | None:
    """The dtype the step's matmuls run in under autocast (None: no autocast, fp32)."""
    return torch.bfloat16 if config.dtype == "bfloat16" else None


def steps_accumulate(config: TrainConfig) -> bool:
    """Whether a step's gradient sums several backwards (grad_accum > 1, or chunk-recurrent training):
    OffloadRuntime's `accumulates`; else its layers keep the matrices' gradients in the compute
    dtype. A chunked run accumulates even at one chunk (a batch's chunks are known as it runs)."""
    return config.grad_accum > 1 or config.long.chunk_tokens is not None


def peak_gpu_bytes(device: str) -> dict:
    """{"peak_gpu_bytes": the most memory allocated on the GPU since the previous reading,
    "peak_gpu_reserved_bytes": the most torch's caching allocator held from the device meanwhile}
    (then reset); {} on the CPU."""
    if not device.startswith("cuda"):
        return {}
    peak = {"peak_gpu_bytes": torch.cuda.max_memory_allocated(device),
            "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    torch.cuda.reset_peak_memory_stats(device)
    return peak
