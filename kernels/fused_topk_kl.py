"""Fused lm-head + top-k KL distillation loss, chunked over rows (the student's training loss).

The student's [N, V] logits never exist in full. Torch path, forward, per row chunk: logits =
h @ W^T in the input dtype, then fp32 logsumexp, the loss terms and the chunk's gradient
coefficients (a few numbers per row and per top-k entry). Backward recomputes each chunk's
logits and accumulates grad_h = G W and grad_W += G^T h, where G is the chunk's gradient with
respect to its logits. Saved for backward: h, W, per-row logsumexps and [N, k] coefficients;
never anything [N, V]. Triton path: the same G per chunk, built in place over the chunk's logits
during the forward, and both gradients accumulated there; saved: grad_h [N, d] and grad_W [V, d].

Notation, per row: z the student logits over the full vocabulary, T the training temperature,
q = softmax(z / T) over the full vocabulary, S the teacher's k cached ids, l_v (v in S) the
cached teacher log-probabilities (full-vocabulary, not renormalised) and t the cached log tail
mass log(1 - sum_S exp(l)). The teacher at temperature T is defined, as DESIGN.md asks, on the
k + 1 categories "top-k plus tail": P_v = exp(l_v / T) / Z_T for v in S and
P_tail = exp(t / T) / Z_T, with Z_T = sum_S exp(l / T) + exp(t / T). At T = 1 and a consistent
cache this is the cached p itself (Z_1 = 1, up to the cache's 1e-12 floor of the tail mass).

Tail modes (KL is forward KL, teacher || student):
  "unnormalized" (the paper): KL = sum_S P_v (log P_v - log q_v). The tail mass 1 - M, with
      M = sum_S P_v, is dropped: the student is pushed to put no mass outside S.
      d KL / d(z / T) = M q - P (P zero outside S).
  "renorm": KL(P^ || q^), P^ = P / M and q^_v = q_v / sum_S q over S only (P^ does not depend on
      the tail, so it is softmax(l / T) over S). d KL / d(z / T) = q^ - P^ on S, zero elsewhere.
  "bucket": KL over the k + 1 categories: sum_S P_v (log P_v - log q_v)
      + P_tail (log P_tail - log Q_tail), Q_tail = 1 - sum_S q = sum of q outside S (taken as a
      logsumexp over the non-top-k logits, never as 1 - sum, which cancels).
      d KL / d(z / T) = (1 - P_tail / Q_tail) q + [v in S] (q_v P_tail / Q_tail - P_v).
Temperature: the KL term is multiplied by T^2 (Hinton et al.), so its gradient keeps the same
scale as T changes; at T = 1 nothing changes. d/dz = (1 / T) d/d(z / T).
Cross-entropy: CE = logsumexp(z) - z[target], at T = 1 over the full vocabulary.

loss = (1 - ce_weight) * T^2 * KL_red + ce_weight * CE_red, where with reduction "mean" KL_red is
the mean of KL over unmasked rows and CE_red the mean of CE over unmasked rows whose target is not
-1 (each 0 when it has no rows); with reduction "sum" both are plain sums over those rows.

Layout: ``topk_kl_dense`` is the dense reference (full logits, autograd; tests and benchmarks);
``fused_topk_kl_torch`` the chunked plain-torch path (the CPU path, recomputing logits in
backward: 4 matmuls) with its autograd Function ``_FusedTopkKLFunction``; the GPU path is
``fused_topk_kl_triton`` in kernels/fused_topk_kl_triton.py (gradients taken during the forward,
Liger-style, so 3 matmuls, and one Triton program per row that reads the chunk's input-dtype
logits once and writes them once, leaving the gradient up to a per-row factor);
``fused_topk_kl`` validates inputs and dispatches on ``impl``.
"""

from __future__ import annotations

import os

import torch

from kernels.topk_logprobs import auto_chunk_size

try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None

TAIL_MODES = ("renorm", "bucket", "unnormalized")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 / bf16 / fp16 inputs; fp64 stays fp64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _teacher_logprobs(topk_logprobs, tail_logmass, tail: str, temperature: float):
    """Teacher log-probabilities at the training temperature: (log P over S [N, k], log P_tail [N]).

    For "renorm" the tail is not used: log P^ = log_softmax(l / T) over S, and log P_tail is None.
    """
    lp_NK = topk_logprobs / temperature
    if tail == "renorm":
        return torch.log_softmax(lp_NK, dim=-1), None
    both_NK1 = torch.cat([lp_NK, (tail_logmass / temperature)[:, None]], dim=-1)
    log_z_N = torch.logsumexp(both_NK1, dim=-1)
    return lp_NK - log_z_N[:, None], tail_logmass / temperature - log_z_N


def _plogp_diff(logp, logq):
    """P (log P - log Q), elementwise, with 0 where P = 0 (log P = -inf)."""
    return torch.where(logp > float("-inf"), logp.exp() * (logp - logq), torch.zeros_like(logp))


def _row_weights(mask, target_ids, num_rows, ce_weight, temperature, reduction, device):
    """Per-row weights (KL [N], CE [N]) that fold in ce_weight, T^2, the mask and the reduction."""
    keep_N = torch.ones(num_rows, dtype=torch.bool, device=device) if mask is None else mask
    has_target_N = keep_N & (target_ids >= 0) if target_ids is not None else torch.zeros_like(keep_N)
    kl_w_N = keep_N.double() * ((1.0 - ce_weight) * temperature**2)
    ce_w_N = has_target_N.double() * ce_weight
    if reduction == "mean":
        kl_w_N = kl_w_N / keep_N.sum().clamp_min(1)
        ce_w_N = ce_w_N / has_target_N.sum().clamp_min(1)
    return kl_w_N, ce_w_N


# --- dense reference ---------------------------------------------------------------------------


def _dense_loss(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, tail,
                temperature, ce_weight, reduction):
    """Full [N, V] logits, every term written as in the module docstring; autograd differentiates."""
    acc = _compute_dtype(hidden.dtype)
    z_NV = (hidden @ weight.T).to(acc)
    ids_NK = topk_ids.long()
    logq_NV = torch.log_softmax(z_NV / temperature, dim=-1)
    logq_NK = logq_NV.gather(1, ids_NK)
    logp_NK, logp_tail_N = _teacher_logprobs(topk_logprobs.to(acc), tail_logmass.to(acc), tail, temperature)
    if tail == "renorm":
        kl_N = _plogp_diff(logp_NK, torch.log_softmax(logq_NK, dim=-1)).sum(-1)
    else:
        kl_N = _plogp_diff(logp_NK, logq_NK).sum(-1)
    if tail == "bucket":
        log_qtail_N = torch.logsumexp(logq_NV.scatter(1, ids_NK, float("-inf")), dim=-1)
        kl_N = kl_N + _plogp_diff(logp_tail_N, log_qtail_N)
    kl_w_N, ce_w_N = _row_weights(mask, target_ids, hidden.shape[0], ce_weight, temperature, reduction, hidden.device)
    loss = torch.where(kl_w_N != 0, kl_w_N.to(acc) * kl_N, 0).sum()
    if target_ids is not None:
        logq1_N = torch.log_softmax(z_NV, dim=-1).gather(1, target_ids.long().clamp_min(0)[:, None])[:, 0]
        loss = loss + torch.where(ce_w_N != 0, -ce_w_N.to(acc) * logq1_N, 0).sum()
    return loss, kl_N.detach()


# --- chunked torch path --------------------------------------------------------------------------


def _kl_terms(logq_CK, log_qtail_C, logp_CK, logp_tail_C, kl_w_C, tail, temperature):
    """Weighted KL loss of a chunk, its coefficients on d loss / d z and the unweighted per-row KL
    (0 on rows of weight 0): (loss, cq [C], cs [C, k], kl [C]).

    logq_CK: log q over S; log_qtail_C: log Q_tail (bucket only, else None).
    """
    p_CK = logp_CK.exp()
    if tail == "renorm":
        logqhat_CK = torch.log_softmax(logq_CK, dim=-1)
        kl_C = _plogp_diff(logp_CK, logqhat_CK).sum(-1)
        cq_C, cs_CK = torch.zeros_like(kl_C), logqhat_CK.exp() - p_CK
    else:
        kl_C = _plogp_diff(logp_CK, logq_CK).sum(-1)
        cq_C, cs_CK = p_CK.sum(-1), -p_CK
    if tail == "bucket":
        kl_C = kl_C + _plogp_diff(logp_tail_C, log_qtail_C)
        ratio_C = (logp_tail_C - log_qtail_C).exp()  # P_tail / Q_tail
        cq_C, cs_CK = 1.0 - ratio_C, logq_CK.exp() * ratio_C[:, None] - p_CK
    loss = torch.where(kl_w_C != 0, kl_w_C * kl_C, 0).sum()
    scale_C = torch.where(kl_w_C != 0, kl_w_C / temperature, 0)  # masked rows: 0, even if NaN
    cq_C = torch.where(scale_C != 0, scale_C * cq_C, 0)
    cs_CK = torch.where(scale_C[:, None] != 0, scale_C[:, None] * cs_CK, 0)
    return loss, cq_C, cs_CK, torch.where(kl_w_C != 0, kl_C, 0)


def _chunk_forward(z_CV, ids_CK, logp_CK, logp_tail_C, target_C, kl_w_C, ce_w_C, tail, temperature):
    """Loss of one chunk and its gradient coefficients; z_CV (fp32/fp64) is overwritten.

    Returns (loss, lse of z / T [C], lse of z [C], coef of q [C], coef of softmax(z) [C],
    sparse coefs on S [C, k], coef on the target [C]) such that
    d loss / d z = cq q + c1 softmax(z) + scatter(S, cs) + ct onehot(target).
    """
    lse1_C = torch.logsumexp(z_CV, dim=-1)
    loss, ct_C = z_CV.new_zeros(()), torch.zeros_like(lse1_C)
    if target_C is not None:
        z_t_C = z_CV.gather(1, target_C.clamp_min(0)[:, None])[:, 0]
        loss = torch.where(ce_w_C != 0, ce_w_C * (lse1_C - z_t_C), 0).sum()
        ct_C = -ce_w_C
    s_CV = z_CV.div_(temperature) if temperature != 1.0 else z_CV
    lse_C = torch.logsumexp(s_CV, dim=-1) if temperature != 1.0 else lse1_C
    logq_CK = s_CV.gather(1, ids_CK) - lse_C[:, None]
    log_qtail_C = None
    if tail == "bucket":
        log_qtail_C = torch.logsumexp(s_CV.scatter_(1, ids_CK, float("-inf")), dim=-1) - lse_C
    kl_loss, cq_C, cs_CK, kl_C = _kl_terms(logq_CK, log_qtail_C, logp_CK, logp_tail_C, kl_w_C, tail, temperature)
    return loss + kl_loss, lse_C, lse1_C, cq_C, ce_w_C, cs_CK, ct_C, kl_C


def _chunk_grad_logits(z_CV, ids_CK, target_C, lse_C, lse1_C, cq_C, c1_C, cs_CK, ct_C, temperature):
    """d loss / d z for one chunk, built in place in z_CV (fp32/fp64 logits)."""
    if temperature == 1.0 or target_C is None:  # one softmax serves both terms, or CE is off
        g_CV = z_CV.div_(temperature).sub_(lse_C[:, None]).exp_().mul_((cq_C + c1_C)[:, None])
    else:
        q1_CV = (z_CV - lse1_C[:, None]).exp_()
        g_CV = z_CV.div_(temperature).sub_(lse_C[:, None]).exp_().mul_(cq_C[:, None])
        g_CV.add_(q1_CV.mul_(c1_C[:, None]))
    g_CV.scatter_add_(1, ids_CK, cs_CK)
    if target_C is not None:
        g_CV.scatter_add_(1, target_C.clamp_min(0)[:, None], ct_C[:, None])
    return g_CV


class _FusedTopkKLFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, topk_ids, logp_NK, logp_tail_N, target_ids, kl_w_N, ce_w_N,
                tail, temperature, chunk_size):
        acc = _compute_dtype(hidden.dtype)
        num_rows, k = topk_ids.shape
        ids_NK = topk_ids.long()
        tgt_N = target_ids.long() if target_ids is not None else None
        kl_w_N, ce_w_N = kl_w_N.to(acc), ce_w_N.to(acc)
        saved = {n: hidden.new_empty(num_rows, dtype=acc) for n in ("lse", "lse1", "cq", "ct")}
        cs_NK = hidden.new_empty(num_rows, k, dtype=acc)
        loss = hidden.new_zeros((), dtype=acc)
        kl_N = hidden.new_empty(num_rows, dtype=acc)
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, min(start + chunk_size, num_rows))
            z_CV = (hidden[rows] @ weight.T).to(acc)  # matmul in the input dtype
            out = _chunk_forward(
                z_CV, ids_NK[rows], logp_NK[rows], None if logp_tail_N is None else logp_tail_N[rows],
                None if tgt_N is None else tgt_N[rows], kl_w_N[rows], ce_w_N[rows], tail, temperature,
            )
            loss += out[0]
            saved["lse"][rows], saved["lse1"][rows], saved["cq"][rows] = out[1], out[2], out[3]
            cs_NK[rows], saved["ct"][rows], kl_N[rows] = out[5], out[6], out[7]
        ctx.save_for_backward(hidden, weight, ids_NK, tgt_N, saved["lse"], saved["lse1"], saved["cq"],
                              ce_w_N, cs_NK, saved["ct"])
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(kl_N)
        return loss, kl_N

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl):
        hidden, weight, ids_NK, tgt_N, lse_N, lse1_N, cq_N, c1_N, cs_NK, ct_N = ctx.saved_tensors
        acc = lse_N.dtype
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w_acc = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        g = grad_loss.to(acc)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, min(start + ctx.chunk_size, hidden.shape[0]))
            h_C = hidden[rows]
            z_CV = (h_C @ weight.T).to(acc)
            g_CV = _chunk_grad_logits(
                z_CV, ids_NK[rows], None if tgt_N is None else tgt_N[rows], lse_N[rows], lse1_N[rows],
                g * cq_N[rows], g * c1_N[rows], g * cs_NK[rows], g * ct_N[rows], ctx.temperature,
            ).to(hidden.dtype)
            if grad_h is not None:
                grad_h[rows] = g_CV @ weight
            if grad_w_acc is not None:
                grad_w_acc += g_CV.T @ h_C  # accumulated across chunks in fp32
        grad_w = grad_w_acc.to(weight.dtype) if grad_w_acc is not None else None
        return grad_h, grad_w, *([None] * 9)


def fused_topk_kl_torch(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, tail,
                        temperature, ce_weight, chunk_size, reduction):
    """Chunked plain-torch path; inputs are assumed valid (see ``fused_topk_kl``)."""
    acc = _compute_dtype(hidden.dtype)
    logp_NK, logp_tail_N = _teacher_logprobs(topk_logprobs.to(acc), tail_logmass.to(acc), tail, temperature)
    kl_w_N, ce_w_N = _row_weights(mask, target_ids, hidden.shape[0], ce_weight, temperature, reduction, hidden.device)
    if ce_weight == 0.0:
        target_ids = None
    return _FusedTopkKLFunction.apply(
        hidden, weight, topk_ids, logp_NK, logp_tail_N, target_ids, kl_w_N, ce_w_N, tail, temperature, chunk_size
    )


# --- validation and the public functions ---------------------------------------------------------


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


def _validate(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, tail,
              temperature, ce_weight, chunk_size, reduction, impl, grad_weight_fp32, check_ids) -> None:
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
    if not (isinstance(temperature, (int, float)) and 0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if not (isinstance(ce_weight, (int, float)) and 0.0 <= ce_weight <= 1.0):
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight!r}")
    if ce_weight > 0 and target_ids is None:
        raise ValueError(f"ce_weight={ce_weight} needs target_ids; pass them or set ce_weight=0")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if impl == "triton":
        if triton is None:
            raise ValueError("impl='triton' needs the triton package (pip install triton), or use impl='torch'")
        if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"impl='triton' takes fp32, bf16 or fp16 inputs, got {hidden.dtype}; use impl='torch'")
        if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {dev}; use impl='torch'")
    if check_ids:
        _check_id_values(topk_ids, target_ids, vocab_size)


def _check_id_values(topk_ids, target_ids, vocab_size) -> None:
    """Range and uniqueness of the ids (a device sync on a GPU)."""
    if topk_ids.numel() and (topk_ids.min() < 0 or topk_ids.max() >= vocab_size):
        raise ValueError(
            f"topk_ids: k ids must be in [0, V={vocab_size}), got values in "
            f"[{int(topk_ids.min())}, {int(topk_ids.max())}]"
        )
    sorted_NK = topk_ids.sort(dim=1).values
    if (sorted_NK[:, 1:] == sorted_NK[:, :-1]).any():
        raise ValueError("topk_ids must hold k distinct ids per row; some row repeats an id")
    if target_ids is not None and target_ids.numel() and (target_ids.min() < -1 or target_ids.max() >= vocab_size):
        raise ValueError(
            f"target_ids must be in [0, V={vocab_size}) or -1 for none, got values in "
            f"[{int(target_ids.min())}, {int(target_ids.max())}]"
        )


def _prepare(args: dict) -> dict:
    """Validate, and give masked rows finite teacher values (they may hold padding garbage)."""
    check_ids, return_kl = args.pop("check_ids"), args.pop("return_kl")
    _validate(**args, check_ids=check_ids)
    args["return_kl"] = return_kl
    if args["mask"] is not None:
        keep_N = args["mask"]
        args["topk_logprobs"] = torch.where(keep_N[:, None], args["topk_logprobs"], 0.0)
        args["tail_logmass"] = torch.where(keep_N, args["tail_logmass"], 0.0)
    args["temperature"], args["ce_weight"] = float(args["temperature"]), float(args["ce_weight"])
    return args


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
    ce_weight: float = 0.0,
    chunk_size: int | None = None,
    reduction: str = "mean",
    impl: str = "auto",
    grad_weight_fp32: bool = False,
    check_ids: bool = True,
    return_kl: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Distillation loss of the student ``hidden @ weight.T`` against cached top-k teacher targets.

    hidden: [N, d] final hidden states (fp32, bf16, fp16 or fp64); weight: [V, d] lm-head, same
    dtype and device. topk_ids: int32/int64 [N, k], distinct ids in [0, V) per row.
    topk_logprobs: float [N, k], the teacher's full-vocabulary log-probabilities (as cached; not
    renormalised). tail_logmass: float [N], log(1 - sum(exp(topk_logprobs))). target_ids:
    int32/int64 [N], the actual next token, -1 for none (needed when ce_weight > 0). mask: bool
    [N], True for rows that count (masked rows may hold any finite or non-finite teacher values,
    but valid ids). tail: "renorm" | "bucket" | "unnormalized"; temperature: the training
    temperature T; ce_weight in [0, 1]; formulas in the module docstring. chunk_size: rows per
    chunk (None: torch path about 256 MiB of fp32 logits per chunk, Triton path at most 768 MiB of
    input-dtype logits). reduction: "mean" | "sum". impl: "auto" (Triton for CUDA tensors of
    fp32 / bf16 / fp16 when Triton is installed, else torch) | "torch" | "triton" (also runs on
    the CPU under TRITON_INTERPRET=1, for tests). grad_weight_fp32: Triton path only, accumulate
    grad_weight across chunks in fp32 (4 V d extra bytes) instead of the weight's dtype (the
    torch path always accumulates in fp32). check_ids: check id ranges and uniqueness (a device
    sync on a GPU; out-of-range ids read outside the logits). return_kl: also return the KL term
    alone, detached, for logging: KL(teacher || student) at temperature T over the unmasked rows
    (before the T^2 factor and the (1 - ce_weight) weight), reduced as the loss is; with
    0 <= ce_weight < 1 it comes out of the same pass (with ce_weight = 1 it takes a forward-only
    second pass, as its weight in the loss is 0).

    Returns a scalar loss (fp32; fp64 for fp64 inputs), or (loss, kl) with return_kl. Gradients flow
    to hidden and weight only; the teacher tensors are constants. The Triton path computes both
    gradients during the forward (only for the inputs that require grad, and none under no_grad)
    and holds them until backward, which can run once.
    """
    args = _prepare(dict(locals()))
    return_kl = args.pop("return_kl")
    loss, kl_N = _fused_dispatch(dict(args))
    if not return_kl:
        return loss
    if args["ce_weight"] == 1.0:  # KL weighs 0 in the loss: take it from a forward-only pass
        with torch.no_grad():
            _, kl_N = _fused_dispatch(dict(args, ce_weight=0.0))
    return loss, _reduce_kl(kl_N, args["mask"], args["reduction"], loss.dtype)


def _reduce_kl(kl_N, mask, reduction, dtype):
    """The per-row KL (0 on masked rows) reduced as the loss: mean over unmasked rows, or sum."""
    keep_w_N, _ = _row_weights(mask, None, kl_N.shape[0], 0.0, 1.0, reduction, kl_N.device)
    return (kl_N.double() * keep_w_N).sum().to(dtype)


def _fused_dispatch(args: dict):
    """(loss, per-row KL) from the Triton or the torch path, per ``impl``."""
    impl, hidden, weight = args.pop("impl"), args["hidden"], args["weight"]
    use_triton = impl == "triton" or (
        impl == "auto" and triton is not None and hidden.is_cuda
        and hidden.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
    if use_triton:
        # imported here: the Triton module imports this one's shared helpers
        from kernels.fused_topk_kl_triton import fused_topk_kl_triton, triton_chunk_size

        if args["chunk_size"] is None:
            args["chunk_size"] = triton_chunk_size(hidden.shape[0], weight.shape[0], weight.element_size())
        return fused_topk_kl_triton(**args)
    args.pop("grad_weight_fp32")
    if args["chunk_size"] is None:
        args["chunk_size"] = auto_chunk_size(weight.shape[0])
    return fused_topk_kl_torch(**args)


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
    ce_weight: float = 0.0,
    chunk_size: int | None = None,
    reduction: str = "mean",
    impl: str = "auto",
    grad_weight_fp32: bool = False,
    check_ids: bool = True,
    return_kl: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same loss as ``fused_topk_kl`` from the full [N, V] logits and autograd: the reference.

    Same arguments; chunk_size, impl and grad_weight_fp32 are accepted for a drop-in call and
    ignored.
    """
    args = _prepare(dict(locals()))
    return_kl = args.pop("return_kl")
    for unused in ("chunk_size", "impl", "grad_weight_fp32"):
        args.pop(unused)
    loss, kl_N = _dense_loss(**args)
    if not return_kl:
        return loss
    kl_N = torch.where(args["mask"], kl_N, 0) if args["mask"] is not None else kl_N
    return loss, _reduce_kl(kl_N, args["mask"], args["reduction"], loss.dtype)
