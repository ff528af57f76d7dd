"""Fused lm-head + top-k KL distillation loss, chunked over rows (the student's training loss).

The student's [N, V] logits never exist in full. ``fused_topk_kl`` validates its arguments once
and dispatches on ``impl``: the Triton path (kernels/fused_topk_kl_triton.py: gradients taken
during the forward, three matmuls, the GPU default) or the chunked torch path
(kernels/fused_topk_kl_torch.py: backward recomputes the logits, four matmuls, the CPU path).
``topk_kl_dense`` computes the same loss from full logits with autograd: the reference both are
tested against. All three take a sampled cache's targets (``target_weights``: the RS-KD estimate
of the full-vocabulary KL) as well as top-k ones. The loss's formulas, its tail modes and its
temperatures are in kernels/fused_topk_kl_torch.py's docstring; how each path runs is set by
``FusedKLSettings``.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kernels.fused_topk_kl_torch import (
    REDUCTIONS,
    TAIL_MODES,
    FusedKLSettings,
    LossSpec,
    dense_loss,
    fused_topk_kl_torch,
    reduce_kl,
)
from kernels.temperature_rule import temperature_problem

try:
    from kernels import fused_topk_kl_triton as _triton_path
except ImportError:  # no Triton: the torch path needs none
    _triton_path = None

__all__ = ["TAIL_MODES", "FusedKLSettings", "fused_topk_kl", "topk_kl_dense"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_topk_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    tail_logmass: torch.Tensor,
    *,
    target_ids: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    tail: str = "renorm",
    temperature: float = 1.0,
    cache_temperature: float = 1.0,
    ce_weight: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    impl: str = "auto",
    grad_weight_fp32: bool = False,
    check_ids: bool = True,
    return_kl: bool = False,
    settings: FusedKLSettings | None = None,
    target_weights: torch.Tensor | None = None,
    jsd_beta: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Distillation loss of the student ``hidden @ weight.T`` against cached top-k teacher targets.

    hidden: [N, d] final hidden states (fp32, bf16, fp16 or fp64); weight: [V, d] lm-head, same
    dtype and device. topk_ids: int32/int64 [N, k], distinct ids in [0, V) per row.
    topk_logprobs: float [N, k], the teacher's full-vocabulary log-probabilities as cached (at
    cache_temperature; not renormalised). tail_logmass: float [N], log(1 - sum(exp(topk_logprobs))).
    target_ids: int32/int64 [N], the actual next token, -1 for none (needed when ce_weight > 0).
    mask: bool [N], True for rows that count (masked rows may hold any finite or non-finite teacher
    values, but valid ids). tail: "renorm" | "bucket" | "unnormalized". temperature: the
    distillation temperature T (student logits / T, KL scaled by T^2). cache_temperature: the
    temperature the cached values were written at; "renorm" tempers the cached top-k to T exactly,
    "bucket" and "unnormalized" need T == cache_temperature (ValueError otherwise). ce_weight in
    [0, 1]. reduction: "mean" | "sum" | "none" (per-row loss [N]; on the Triton path only where
    no gradient is needed). Formulas in kernels/fused_topk_kl_torch.py. chunk_size: rows per chunk
    (None: from the settings' byte budgets). impl: "auto" (Triton for CUDA tensors of fp32 / bf16 /
    fp16 when Triton is installed, else torch) | "torch" | "triton" (also on the CPU under
    TRITON_INTERPRET=1, for tests). grad_weight_fp32: Triton path only, accumulate grad_weight
    across chunks in fp32 (4 V d extra bytes) instead of the weight's dtype (the torch path always
    accumulates in fp32). check_ids: check id ranges and uniqueness (a device sync on a GPU;
    out-of-range ids read outside the logits), and that target_weights are finite and >= 0 on
    unmasked rows. return_kl: also return the KL term alone, detached, for logging and
    evaluation: KL(teacher || student) at T over the unmasked rows (before the T^2
    factor and the (1 - ce_weight) weight), reduced as the loss is; with 0 <= ce_weight < 1 it comes
    out of the same pass (with ce_weight = 1 from a forward-only second pass, as its weight in the
    loss is 0). settings: how the kernels run (``FusedKLSettings``; None: the defaults).
    target_weights: float [N, k] >= 0 or None. A sampled cache's targets: topk_ids then hold a row's
    unique sampled ids (padding slots: weight 0), topk_logprobs the teacher's log p of each, and
    the weights w = (count / samples) p / proposal; the KL term is then the unbiased estimate
    sum w (log p - log q) of the full-vocabulary KL (formulas in kernels/fused_topk_kl_torch.py),
    which needs tail="unnormalized" and temperature == cache_temperature (ValueError otherwise);
    tail_logmass is not read. Masked rows may hold any weights. return_kl returns that estimate.
    jsd_beta: beta in (0, 1), or None. The generalised Jensen-Shannon divergence of teacher and
    student over the top-k and the tail bucket takes the KL's place (formulas in
    kernels/fused_topk_kl_torch.py); it needs tail="bucket" and top-k targets (ValueError
    otherwise). return_kl then returns it.

    Returns the loss (fp32; fp64 for fp64 inputs), or (loss, kl) with return_kl. Gradients flow to
    hidden and weight only; the teacher tensors are constants. The Triton path computes both
    gradients during the forward (only for the inputs that require grad, and none under no_grad)
    and holds them until backward, which can run once.
    """
    spec = _validated(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, tail, temperature,
                      cache_temperature, ce_weight, reduction, check_ids, target_weights, jsd_beta)
    _check_run_options(hidden, chunk_size, impl, settings)
    settings = settings if settings is not None else FusedKLSettings()
    topk_logprobs, tail_logmass, target_weights = _finite_teacher(topk_logprobs, tail_logmass, target_weights, mask)
    need_h, need_w = (torch.is_grad_enabled() and t.requires_grad for t in (hidden, weight))
    use_triton = impl == "triton" or (impl == "auto" and _triton_path is not None and hidden.is_cuda
                                      and hidden.dtype in _TRITON_DTYPES)
    if use_triton and reduction == "none" and (need_h or need_w):
        raise ValueError("reduction='none' takes no gradient on the Triton path (it sums the gradients during "
                         "the forward); use 'sum' or 'mean', impl='torch', or call under torch.no_grad()")

    def run(spec: LossSpec, need_h: bool, need_w: bool):
        if use_triton:
            return _triton_path.fused_topk_kl_triton(hidden, weight, topk_ids, topk_logprobs, tail_logmass,
                                                     target_ids, mask, spec, chunk_size, settings, grad_weight_fp32,
                                                     need_h, need_w, target_weights)
        return fused_topk_kl_torch(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, spec,
                                   chunk_size, settings, target_weights)

    loss, kl_N = run(spec, need_h, need_w)
    if not return_kl:
        return loss
    if spec.ce_weight == 1.0:  # KL weighs 0 in the loss: take it from a forward-only pass
        with torch.no_grad():
            _, kl_N = run(dataclasses.replace(spec, ce_weight=0.0), False, False)
    return loss, reduce_kl(kl_N, mask, reduction, loss.dtype)


def topk_kl_dense(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    tail_logmass: torch.Tensor,
    *,
    target_ids: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    tail: str = "renorm",
    temperature: float = 1.0,
    cache_temperature: float = 1.0,
    ce_weight: float = 0.0,
    reduction: str = "mean",
    check_ids: bool = True,
    return_kl: bool = False,
    target_weights: torch.Tensor | None = None,
    jsd_beta: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The loss of ``fused_topk_kl`` from the full [N, V] logits and autograd: the reference (tests
    and benchmarks). Same loss arguments, same validation, same returns."""
    spec = _validated(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, tail, temperature,
                      cache_temperature, ce_weight, reduction, check_ids, target_weights, jsd_beta)
    topk_logprobs, tail_logmass, target_weights = _finite_teacher(topk_logprobs, tail_logmass, target_weights, mask)
    loss, kl_N = dense_loss(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, spec,
                            target_weights)
    return (loss, reduce_kl(kl_N, mask, reduction, loss.dtype)) if return_kl else loss


def _finite_teacher(topk_logprobs, tail_logmass, target_weights, mask):
    """Masked rows get finite teacher values and zero weights (they may hold padding garbage)."""
    if mask is None:
        return topk_logprobs, tail_logmass, target_weights
    if target_weights is not None:
        target_weights = torch.where(mask[:, None], target_weights, 0.0)
    return torch.where(mask[:, None], topk_logprobs, 0.0), torch.where(mask, tail_logmass, 0.0), target_weights


# --- validation ----------------------------------------------------------------------------------


def _validated(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, tail, temperature,
               cache_temperature, ce_weight, reduction, check_ids, target_weights=None, jsd_beta=None) -> LossSpec:
    """Check the inputs and the loss's options; returns the options as a LossSpec."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, d] and weight [V, d], got shapes {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden width {hidden.shape[1]} does not match weight width {weight.shape[1]}")
    if hidden.dtype != weight.dtype or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden and weight must share a floating-point dtype, got {hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device:
        raise ValueError(f"hidden and weight must be on one device, got {hidden.device} and {weight.device}")
    (num_rows, _), vocab_size, dev = hidden.shape, weight.shape[0], hidden.device
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_rows:
        raise ValueError(f"topk_ids must have shape [N={num_rows}, k], got {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k (topk_ids.shape[1]) must be in [1, vocab_size={vocab_size}], got {k}")
    _check_int_ids("topk_ids", topk_ids, (num_rows, k), dev)
    _check_float("topk_logprobs", topk_logprobs, (num_rows, k), dev)
    _check_float("tail_logmass", tail_logmass, (num_rows,), dev)
    if target_ids is not None:
        _check_int_ids("target_ids", target_ids, (num_rows,), dev)
    if mask is not None and (mask.shape != (num_rows,) or mask.dtype != torch.bool or mask.device != dev):
        raise ValueError(f"mask must be a bool tensor of shape ({num_rows},) on {dev}, got {mask.dtype} "
                         f"{tuple(mask.shape)} on {mask.device}")
    if tail not in TAIL_MODES:
        raise ValueError(f"tail must be one of {TAIL_MODES}, got {tail!r}")
    if tail == "bucket" and k == vocab_size:
        raise ValueError(f"tail='bucket' needs k < vocab_size={vocab_size} (no tail is left), got k={k}")
    for name, value in (("temperature", temperature), ("cache_temperature", cache_temperature)):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if target_weights is not None:
        _check_sampled(target_weights, (num_rows, k), dev, tail)
    problem = temperature_problem(tail, temperature, cache_temperature, "topk" if target_weights is None else "sampled")
    if problem is not None:
        raise ValueError(f"temperature {problem}")
    if isinstance(ce_weight, bool) or not (isinstance(ce_weight, (int, float)) and 0.0 <= ce_weight <= 1.0):
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight!r}")
    if ce_weight > 0 and target_ids is None:
        raise ValueError(f"ce_weight={ce_weight} needs target_ids; pass them or set ce_weight=0")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if check_ids:
        _check_id_values(topk_ids, target_ids, vocab_size)
        if target_weights is not None:
            _check_weight_values(target_weights, mask)
    if jsd_beta is not None:
        if isinstance(jsd_beta, bool) or not (isinstance(jsd_beta, (int, float)) and 0.0 < jsd_beta < 1.0):
            raise ValueError(f"jsd_beta must be in (0, 1) (0 is the forward KL's limit, 1 the reverse KL's), got "
                             f"{jsd_beta!r}")
        if tail != "bucket" or target_weights is not None:
            raise ValueError(f"jsd_beta needs tail='bucket' and top-k targets (the teacher normalised over the top-k "
                             f"and its tail), got tail={tail!r}{' and sampled targets' * (target_weights is not None)}")
        jsd_beta = float(jsd_beta)
    return LossSpec(tail, float(temperature), float(cache_temperature), float(ce_weight), reduction, jsd_beta)


def _check_sampled(target_weights, shape, device, tail) -> None:
    """Sampled targets: their shape, and the only loss form they estimate (unnormalized; the temperature
    is temperature_rule's)."""
    _check_float("target_weights", target_weights, shape, device)
    if tail != "unnormalized":
        raise ValueError(f"target_weights (sampled targets) need tail='unnormalized', the form whose estimate is "
                         f"unbiased, got tail={tail!r}; pass tail='unnormalized'")


def _check_run_options(hidden, chunk_size, impl, settings) -> None:
    """The options of how ``fused_topk_kl`` runs (not what it computes)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if settings is not None and not isinstance(settings, FusedKLSettings):
        raise ValueError(f"settings must be a FusedKLSettings or None, got {type(settings).__name__}")
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if impl == "triton":
        if _triton_path is None:
            raise ValueError("impl='triton' needs the triton package (pip install triton), or use impl='torch'")
        if hidden.dtype not in _TRITON_DTYPES:
            raise ValueError(f"impl='triton' takes fp32, bf16 or fp16 inputs, got {hidden.dtype}; use impl='torch'")
        if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {hidden.device}; "
                             "use impl='torch'")


def _check_int_ids(name, ids, shape, device):
    if ids.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {ids.dtype}")
    if ids.device != device:
        raise ValueError(f"{name} must be on {device}, got {ids.device}")


def _check_float(name, x, shape, device):
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device}, got {x.device}")


def _check_id_values(topk_ids, target_ids, vocab_size) -> None:
    """Range and uniqueness of the ids (a device sync on a GPU)."""
    if topk_ids.numel() and (topk_ids.min() < 0 or topk_ids.max() >= vocab_size):
        raise ValueError(
            f"topk_ids: k ids must be in [0, V={vocab_size}), got values in "
            f"[{int(topk_ids.min())}, {int(topk_ids.max())}]"
        )
    sorted_NK = topk_ids.sort(dim=1).values  # padding slots of sampled targets hold distinct ids too
    if (sorted_NK[:, 1:] == sorted_NK[:, :-1]).any():
        raise ValueError("topk_ids must hold k distinct ids per row; some row repeats an id")
    if target_ids is not None and target_ids.numel() and (target_ids.min() < -1 or target_ids.max() >= vocab_size):
        raise ValueError(
            f"target_ids must be in [0, V={vocab_size}) or -1 for none, got values in "
            f"[{int(target_ids.min())}, {int(target_ids.max())}]"
        )


def _check_weight_values(target_weights, mask) -> None:
    """Sampled targets' weights are finite and >= 0 on the rows that count (a device sync on a GPU)."""
    kept_NK = target_weights if mask is None else target_weights[mask]
    if kept_NK.numel() and not (torch.isfinite(kept_NK) & (kept_NK >= 0)).all():
        bad = kept_NK[~(torch.isfinite(kept_NK) & (kept_NK >= 0))]
        raise ValueError(f"target_weights must be finite and >= 0 on unmasked rows, got {float(bad[0])!r}; "
                         "they are (count / samples) * exp(teacher log-prob - proposal log-prob) per slot")
