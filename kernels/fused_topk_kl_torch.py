"""The fused lm-head + top-k KL loss in plain torch: its math, its settings, the dense reference and
the chunked torch path (the CPU path). kernels/fused_topk_kl.py validates and dispatches;
kernels/fused_topk_kl_triton.py (the GPU path) imports the shared pieces from here.

Notation, per row: z the student logits over the full vocabulary, T the distillation temperature,
q = softmax(z / T) over the full vocabulary, S the teacher's k cached ids, l_v (v in S) the cached
teacher log-probabilities (full-vocabulary, not renormalised) and t the cached log tail mass
log(1 - sum_S exp(l)), both written at the cache temperature T_c. Tempering the teacher from T_c
to T raises its probabilities to the power T_c / T before normalising, so with s = T_c / T the
teacher is, on the k + 1 categories "top-k plus tail" (DESIGN.md): P_v = exp(s l_v) / Z and
P_tail = exp(s t) / Z, Z = sum_S exp(s l) + exp(s t). Over S alone this is exact at any s; the
tail, though, is many tokens, and exp(s t) is its mass tempered as if it were one token. So the
tail modes that use it ("bucket", "unnormalized") accept only T = T_c (s = 1: P is the cached p,
Z = 1 up to the cache's 1e-12 floor of the tail mass) and ``fused_topk_kl`` refuses the rest.

Tail modes (KL is forward KL, teacher || student):
  "unnormalized" (the paper): KL = sum_S P_v (log P_v - log q_v). The tail mass 1 - M, with
      M = sum_S P_v, is dropped: the student is pushed to put no mass outside S.
      d KL / d(z / T) = M q - P (P zero outside S).
  "renorm": KL(P^ || q^), P^ = P / M = softmax(s l) over S and q^_v = q_v / sum_S q over S only;
      exact at every (T, T_c). d KL / d(z / T) = q^ - P^ on S, zero elsewhere.
  "bucket": KL over the k + 1 categories: sum_S P_v (log P_v - log q_v)
      + P_tail (log P_tail - log Q_tail), Q_tail = 1 - sum_S q = sum of q outside S (taken as a
      logsumexp over the non-top-k logits, never as 1 - sum, which cancels).
      d KL / d(z / T) = (1 - P_tail / Q_tail) q + [v in S] (q_v P_tail / Q_tail - P_v).
Sampled targets (``target_weights``; RS-KD, Anshumann et al. 2025): S holds the unique ids u of
  a row's S_n draws with replacement from a proposal r, c_u the draws of u; the weight
  w_u = (c_u / S_n) p_u / r_u (c_u / S_n when r = p) has E[w at v] = p_v at every v. The
  "unnormalized" formulas with P replaced by w (log P stays the cached l, not renormalised):
  KL_est = sum_S w_u (l_u - log q_u), an unbiased estimate of the full KL(p || q), and
  d KL_est / d(z / T) = (sum_S w) q - w, unbiased for q - p. Only at T = T_c, the temperature the
  ids were drawn at (``fused_topk_kl`` refuses the rest); padding slots carry w = 0.
Generalised Jensen-Shannon divergence (``jsd_beta`` = beta in (0, 1); GKD, Agarwal et al. 2024, as
  TRL's generalized_jsd_loss): with M = beta P + (1 - beta) Q over the "bucket" tail's k + 1
  categories c (S and the tail; Q_c = q_c on S, Q_tail as above),
  JSD = beta sum_c P_c (log P_c - log M_c) + (1 - beta) sum_c Q_c (log Q_c - log M_c),
  the generalised JSD of the teacher and the student coarse-grained to those categories (no more
  than the full-vocabulary one: the only form a top-k cache allows). It takes the KL term's place
  (the T^2 factor, the weights, the CE mix and return_kl alike), only with tail "bucket" and top-k
  targets. Its gradient has the KL's shape: with a_c = dJSD/dlog Q_c = (1 - beta) Q_c (log Q_c -
  log M_c) and r = (1 - beta) (log Q_tail - log M_tail),
  d JSD / d(z / T) = (r (1 - Q_tail) - sum_S a) q + [v in S] (a_v - r q_v).
Temperature: the KL term is multiplied by T^2 (Hinton et al.), so its gradient keeps the same
scale as T changes; at T = 1 nothing changes. d/dz = (1 / T) d/d(z / T).
Cross-entropy: CE = logsumexp(z) - z[target], at T = 1 over the full vocabulary.

loss = (1 - ce_weight) * T^2 * KL_red + ce_weight * CE_red, where with reduction "mean" KL_red is
the mean of KL over unmasked rows and CE_red the mean of CE over unmasked rows whose target is not
-1 (each 0 when it has no rows); with "sum" both are plain sums over those rows; with "none" the
loss is per row ([N], 0 on masked rows), each row's terms weighted as in "sum".

Torch path, per row chunk: logits = h @ W^T in the input dtype, then fp32 logsumexp, the loss terms
and the chunk's gradient coefficients (a few numbers per row and per top-k entry). Backward
recomputes each chunk's logits and accumulates grad_h = G W and grad_W += G^T h, where G is the
chunk's gradient with respect to its logits (4 matmuls in all). Saved for backward: h, W, per-row
logsumexps and [N, k] coefficients; never anything [N, V].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from distill.configs import check_types, require

TAIL_MODES = ("renorm", "bucket", "unnormalized")
REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class FusedKLSettings:
    """How the fused KL runs (never what it computes): chunk budgets, Triton block shapes, and
    NaN poisoning for tests. Pass one to ``fused_topk_kl(settings=...)``; the defaults are what the
    product runs."""

    # fp32 logits bytes per chunk of the torch path when chunk_size is None.
    torch_chunk_bytes: int = 256 * 2**20
    # Input-dtype logits bytes per chunk of the Triton path when chunk_size is None: one chunk's
    # buffer stays inside the loss's extra-memory budget of 1 GiB beside the [N, k] teacher
    # tensors, and chunks this large ran level with the fastest chunk sizes measured (the
    # "triton#ROWS" variants in tests/benchmarks/notes, fused KL round 2).
    triton_chunk_bytes: int = 768 * 2**20
    # The scaled row kernel (the gradient route): it reads each logit once, so it wants many
    # rows in flight: narrow blocks and few warps. The fastest of the row-pass sweep
    # (bench_fused_kl_gpu.py --sweep; rows fused_kl_sweep/*) at both vocabularies.
    scaled_block: int = 2048
    scaled_warps: int = 4
    # The direct row kernel (forward-only calls, fp16, CE at T != 1, renorm without CE): one row
    # per program and 32 warps, as Liger's cross-entropy kernel, so that its second read of a row
    # mostly hits L2 (fused KL round 3 in tests/benchmarks/notes).
    direct_block: int = 16384
    direct_warps: int = 32
    # Fill every buffer a kernel is meant to write with NaN first, so an element left unwritten
    # fails the comparison (tests).
    poison: bool = False

    def __post_init__(self):
        check_types(self)
        for name in ("torch_chunk_bytes", "triton_chunk_bytes"):
            require(name, getattr(self, name), getattr(self, name) >= 1, "a positive number of bytes")
        for name in ("scaled_block", "direct_block"):
            value = getattr(self, name)
            require(name, value, value >= 16 and value & (value - 1) == 0, "a power of two >= 16")
        for name in ("scaled_warps", "direct_warps"):
            value = getattr(self, name)
            require(name, value, value in (1, 2, 4, 8, 16, 32), "one of 1, 2, 4, 8, 16, 32")


@dataclass(frozen=True)
class LossSpec:
    """What the loss computes, as ``fused_topk_kl`` validated it (module docstring)."""

    tail: Literal["renorm", "bucket", "unnormalized"]
    temperature: float
    cache_temperature: float
    ce_weight: float
    reduction: Literal["mean", "sum", "none"]
    jsd_beta: float | None = None  # the generalised JSD's beta in place of the KL (bucket tail only)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 / bf16 / fp16 inputs; fp64 stays fp64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def teacher_logprobs(topk_logprobs, tail_logmass, tail: str, temperature: float, cache_temperature: float = 1.0):
    """The teacher at the distillation temperature, from values cached at cache_temperature:
    (log P over S [N, k], log P_tail [N]), the module docstring's P with s = T_c / T.

    For "renorm" the tail is not used: log P^ = log_softmax(s l) over S, and log P_tail is None.
    """
    scale = cache_temperature / temperature
    lp_NK = topk_logprobs * scale if scale != 1.0 else topk_logprobs
    if tail == "renorm":
        return torch.log_softmax(lp_NK, dim=-1), None
    lt_N = tail_logmass * scale if scale != 1.0 else tail_logmass
    log_z_N = torch.logsumexp(torch.cat([lp_NK, lt_N[:, None]], dim=-1), dim=-1)
    return lp_NK - log_z_N[:, None], lt_N - log_z_N


def teacher_values(topk_logprobs, tail_logmass, target_weights, spec: LossSpec, dtype: torch.dtype):
    """(log P over S [N, k], log P_tail [N] or None, w [N, k] or None), in dtype: the teacher at the
    distillation temperature (``teacher_logprobs``), or for sampled targets the cached l as they are
    (T = T_c; the normaliser of the unnormalized tail would count the padding slots' mass) and the
    weights."""
    if target_weights is not None:
        return topk_logprobs.to(dtype), None, target_weights.to(dtype)
    logp_NK, logp_tail_N = teacher_logprobs(topk_logprobs.to(dtype), tail_logmass.to(dtype), spec.tail,
                                            spec.temperature, spec.cache_temperature)
    return logp_NK, logp_tail_N, None


def plogp_diff(logp, logq):
    """P (log P - log Q), elementwise, with 0 where P = 0 (log P = -inf)."""
    return torch.where(logp > float("-inf"), logp.exp() * (logp - logq), torch.zeros_like(logp))


def weighted_diff(w, logp, logq):
    """w (log P - log Q), elementwise, with 0 where w = 0 (padding slots of sampled targets)."""
    return torch.where(w != 0, w * (logp - logq), torch.zeros_like(w))


def row_weights(mask, target_ids, num_rows, ce_weight, temperature, reduction, device):
    """Per-row weights (KL [N], CE [N]) that fold in ce_weight, T^2, the mask and the reduction."""
    keep_N = torch.ones(num_rows, dtype=torch.bool, device=device) if mask is None else mask
    has_target_N = keep_N & (target_ids >= 0) if target_ids is not None else torch.zeros_like(keep_N)
    kl_w_N = keep_N.double() * ((1.0 - ce_weight) * temperature**2)
    ce_w_N = has_target_N.double() * ce_weight
    if reduction == "mean":
        kl_w_N = kl_w_N / keep_N.sum().clamp_min(1)
        ce_w_N = ce_w_N / has_target_N.sum().clamp_min(1)
    return kl_w_N, ce_w_N


def reduce_kl(kl_N, mask, reduction, dtype):
    """The per-row KL (0 on masked rows) reduced as the loss: mean over unmasked rows, sum, or none."""
    if reduction == "none":
        return kl_N.to(dtype)
    keep_w_N, _ = row_weights(mask, None, kl_N.shape[0], 0.0, 1.0, reduction, kl_N.device)
    return (kl_N.double() * keep_w_N).sum().to(dtype)


def reduced(loss_N, reduction):
    """The per-row loss summed (its row weights already hold the mean's divisor), or as is for "none"."""
    return loss_N if reduction == "none" else loss_N.sum()


def _poisoned(t: torch.Tensor, settings: FusedKLSettings) -> torch.Tensor:
    return t.fill_(float("nan")) if settings.poison else t


# --- dense reference ---------------------------------------------------------------------------


def dense_loss(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, spec: LossSpec,
               target_weights=None):
    """Full [N, V] logits, every term written as in the module docstring; autograd differentiates.
    Returns (loss, reduced; KL per row [N], detached, 0 on masked rows)."""
    acc = compute_dtype(hidden.dtype)
    z_NV = (hidden @ weight.T).to(acc)
    ids_NK = topk_ids.long()
    logq_NV = torch.log_softmax(z_NV / spec.temperature, dim=-1)
    logq_NK = logq_NV.gather(1, ids_NK)
    logp_NK, logp_tail_N, w_NK = teacher_values(topk_logprobs, tail_logmass, target_weights, spec, acc)
    if spec.tail == "renorm":
        kl_N = plogp_diff(logp_NK, torch.log_softmax(logq_NK, dim=-1)).sum(-1)
    elif w_NK is not None:
        kl_N = weighted_diff(w_NK, logp_NK, logq_NK).sum(-1)
    else:
        kl_N = plogp_diff(logp_NK, logq_NK).sum(-1)
    if spec.tail == "bucket":
        log_qtail_N = torch.logsumexp(logq_NV.scatter(1, ids_NK, float("-inf")), dim=-1)
        kl_N = kl_N + plogp_diff(logp_tail_N, log_qtail_N)
        if spec.jsd_beta is not None:  # the k + 1 categories' JSD, differentiated by autograd
            logp_NC = torch.cat([logp_NK, logp_tail_N[:, None]], dim=1)
            logq_NC = torch.cat([logq_NK, log_qtail_N[:, None]], dim=1)
            beta = spec.jsd_beta
            logm_NC = torch.logaddexp(math.log(beta) + logp_NC, math.log(1 - beta) + logq_NC)
            kl_N = (beta * plogp_diff(logp_NC, logm_NC) + (1 - beta) * plogp_diff(logq_NC, logm_NC)).sum(-1)
    kl_w_N, ce_w_N = row_weights(mask, target_ids, hidden.shape[0], spec.ce_weight, spec.temperature,
                                 spec.reduction, hidden.device)
    loss_N = torch.where(kl_w_N != 0, kl_w_N.to(acc) * kl_N, 0)
    if target_ids is not None:
        logq1_N = torch.log_softmax(z_NV, dim=-1).gather(1, target_ids.long().clamp_min(0)[:, None])[:, 0]
        loss_N = loss_N + torch.where(ce_w_N != 0, -ce_w_N.to(acc) * logq1_N, 0)
    kl_N = kl_N.detach() if mask is None else torch.where(mask, kl_N.detach(), 0)
    return reduced(loss_N, spec.reduction), kl_N


# --- chunked torch path --------------------------------------------------------------------------


def jsd_terms(logq_CK, log_qtail_C, logp_CK, logp_tail_C, beta):
    """The bucket form's generalised JSD per row and its coefficients on d / d(z / T) before
    weighting (module docstring): (jsd [C], cq [C], cs [C, k])."""
    log_b, log_1b = math.log(beta), math.log(1 - beta)
    logm_CK = torch.logaddexp(log_b + logp_CK, log_1b + logq_CK)
    logm_tail_C = torch.logaddexp(log_b + logp_tail_C, log_1b + log_qtail_C)
    jsd_C = (beta * (plogp_diff(logp_CK, logm_CK).sum(-1) + plogp_diff(logp_tail_C, logm_tail_C))
             + (1 - beta) * (plogp_diff(logq_CK, logm_CK).sum(-1) + plogp_diff(log_qtail_C, logm_tail_C)))
    q_CK = logq_CK.exp()
    a_CK = (1 - beta) * q_CK * (logq_CK - logm_CK)
    r_C = torch.where(log_qtail_C > float("-inf"), (1 - beta) * (log_qtail_C - logm_tail_C), 0)
    cq_C = r_C * (1 - log_qtail_C.exp()) - a_CK.sum(-1)
    return jsd_C, cq_C, a_CK - r_C[:, None] * q_CK


def _kl_terms(logq_CK, log_qtail_C, logp_CK, logp_tail_C, w_CK, kl_w_C, tail, temperature, jsd_beta=None):
    """Weighted KL loss per row of a chunk, its coefficients on d loss / d z and the unweighted
    per-row KL (0 on rows of weight 0): (loss [C], cq [C], cs [C, k], kl [C]).

    logq_CK: log q over S; log_qtail_C: log Q_tail (bucket only, else None); w_CK: sampled
    targets' weights, which take P's place (unnormalized only), or None. jsd_beta: the
    generalised JSD in the KL's place (bucket only).
    """
    p_CK = logp_CK.exp() if w_CK is None else w_CK
    if jsd_beta is not None:
        kl_C, cq_C, cs_CK = jsd_terms(logq_CK, log_qtail_C, logp_CK, logp_tail_C, jsd_beta)
    elif tail == "renorm":
        logqhat_CK = torch.log_softmax(logq_CK, dim=-1)
        kl_C = plogp_diff(logp_CK, logqhat_CK).sum(-1)
        cq_C, cs_CK = torch.zeros_like(kl_C), logqhat_CK.exp() - p_CK
    else:
        diff_CK = plogp_diff(logp_CK, logq_CK) if w_CK is None else weighted_diff(w_CK, logp_CK, logq_CK)
        kl_C = diff_CK.sum(-1)
        cq_C, cs_CK = p_CK.sum(-1), -p_CK
    if tail == "bucket" and jsd_beta is None:
        kl_C = kl_C + plogp_diff(logp_tail_C, log_qtail_C)
        ratio_C = (logp_tail_C - log_qtail_C).exp()  # P_tail / Q_tail
        cq_C, cs_CK = 1.0 - ratio_C, logq_CK.exp() * ratio_C[:, None] - p_CK
    loss_C = torch.where(kl_w_C != 0, kl_w_C * kl_C, 0)
    scale_C = torch.where(kl_w_C != 0, kl_w_C / temperature, 0)  # masked rows: 0, even if NaN
    cq_C = torch.where(scale_C != 0, scale_C * cq_C, 0)
    cs_CK = torch.where(scale_C[:, None] != 0, scale_C[:, None] * cs_CK, 0)
    return loss_C, cq_C, cs_CK, torch.where(kl_w_C != 0, kl_C, 0)


def _chunk_forward(z_CV, ids_CK, logp_CK, logp_tail_C, w_CK, target_C, kl_w_C, ce_w_C, tail, temperature,
                   jsd_beta=None):
    """Loss per row of one chunk and its gradient coefficients; z_CV (fp32/fp64) is overwritten.

    Returns (loss [C], lse of z / T [C], lse of z [C], coef of q [C], coef of softmax(z) [C],
    sparse coefs on S [C, k], coef on the target [C], KL [C]) such that
    d loss / d z = cq q + c1 softmax(z) + scatter(S, cs) + ct onehot(target).
    """
    lse1_C = torch.logsumexp(z_CV, dim=-1)
    loss_C, ct_C = torch.zeros_like(lse1_C), torch.zeros_like(lse1_C)
    if target_C is not None:
        z_t_C = z_CV.gather(1, target_C.clamp_min(0)[:, None])[:, 0]
        loss_C = torch.where(ce_w_C != 0, ce_w_C * (lse1_C - z_t_C), 0)
        ct_C = -ce_w_C
    s_CV = z_CV.div_(temperature) if temperature != 1.0 else z_CV
    lse_C = torch.logsumexp(s_CV, dim=-1) if temperature != 1.0 else lse1_C
    logq_CK = s_CV.gather(1, ids_CK) - lse_C[:, None]
    log_qtail_C = None
    if tail == "bucket":
        log_qtail_C = torch.logsumexp(s_CV.scatter_(1, ids_CK, float("-inf")), dim=-1) - lse_C
    kl_loss_C, cq_C, cs_CK, kl_C = _kl_terms(logq_CK, log_qtail_C, logp_CK, logp_tail_C, w_CK, kl_w_C, tail,
                                             temperature, jsd_beta)
    return loss_C + kl_loss_C, lse_C, lse1_C, cq_C, ce_w_C, cs_CK, ct_C, kl_C


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
    """(loss per row [N], KL per row [N]); backward takes d loss per row, so any reduction works."""

    @staticmethod
    def forward(ctx, hidden, weight, topk_ids, logp_NK, logp_tail_N, w_NK, target_ids, kl_w_N, ce_w_N,
                tail, temperature, chunk_size, settings, jsd_beta):
        acc = compute_dtype(hidden.dtype)
        num_rows, k = topk_ids.shape
        ids_NK = topk_ids.long()
        tgt_N = target_ids.long() if target_ids is not None else None
        kl_w_N, ce_w_N = kl_w_N.to(acc), ce_w_N.to(acc)
        saved = {n: _poisoned(hidden.new_empty(num_rows, dtype=acc), settings) for n in ("lse", "lse1", "cq", "ct")}
        cs_NK = _poisoned(hidden.new_empty(num_rows, k, dtype=acc), settings)
        loss_N = _poisoned(hidden.new_empty(num_rows, dtype=acc), settings)
        kl_N = _poisoned(hidden.new_empty(num_rows, dtype=acc), settings)
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, min(start + chunk_size, num_rows))
            z_CV = (hidden[rows] @ weight.T).to(acc)  # matmul in the input dtype
            out = _chunk_forward(
                z_CV, ids_NK[rows], logp_NK[rows], None if logp_tail_N is None else logp_tail_N[rows],
                None if w_NK is None else w_NK[rows], None if tgt_N is None else tgt_N[rows], kl_w_N[rows], ce_w_N[rows], tail, temperature,
                jsd_beta,
            )
            loss_N[rows], saved["lse"][rows], saved["lse1"][rows], saved["cq"][rows] = out[:4]
            cs_NK[rows], saved["ct"][rows], kl_N[rows] = out[5], out[6], out[7]
        ctx.save_for_backward(hidden, weight, ids_NK, tgt_N, saved["lse"], saved["lse1"], saved["cq"],
                              ce_w_N, cs_NK, saved["ct"])
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(kl_N)
        return loss_N, kl_N

    @staticmethod
    def backward(ctx, grad_loss_N, _grad_kl):
        hidden, weight, ids_NK, tgt_N, lse_N, lse1_N, cq_N, c1_N, cs_NK, ct_N = ctx.saved_tensors
        acc = lse_N.dtype
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w_acc = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        g_N = grad_loss_N.to(acc)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, min(start + ctx.chunk_size, hidden.shape[0]))
            h_C, g_C = hidden[rows], g_N[rows]
            z_CV = (h_C @ weight.T).to(acc)
            g_CV = _chunk_grad_logits(
                z_CV, ids_NK[rows], None if tgt_N is None else tgt_N[rows], lse_N[rows], lse1_N[rows],
                g_C * cq_N[rows], g_C * c1_N[rows], g_C[:, None] * cs_NK[rows], g_C * ct_N[rows], ctx.temperature,
            ).to(hidden.dtype)
            if grad_h is not None:
                grad_h[rows] = g_CV @ weight
            if grad_w_acc is not None:
                grad_w_acc += g_CV.T @ h_C  # accumulated across chunks in fp32
        grad_w = grad_w_acc.to(weight.dtype) if grad_w_acc is not None else None
        return grad_h, grad_w, *([None] * 12)


def fused_topk_kl_torch(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, spec: LossSpec,
                        chunk_size: int | None, settings: FusedKLSettings, target_weights=None):
    """Chunked plain-torch path: (loss, reduced; KL per row [N]); inputs are assumed valid (see
    ``fused_topk_kl``). chunk_size None: rows whose fp32 logits fill settings.torch_chunk_bytes."""
    acc = compute_dtype(hidden.dtype)
    if chunk_size is None:
        chunk_size = max(1, settings.torch_chunk_bytes // (4 * weight.shape[0]))
    logp_NK, logp_tail_N, w_NK = teacher_values(topk_logprobs, tail_logmass, target_weights, spec, acc)
    kl_w_N, ce_w_N = row_weights(mask, target_ids, hidden.shape[0], spec.ce_weight, spec.temperature,
                                 spec.reduction, hidden.device)
    if spec.ce_weight == 0.0:
        target_ids = None
    loss_N, kl_N = _FusedTopkKLFunction.apply(hidden, weight, topk_ids, logp_NK, logp_tail_N, w_NK, target_ids,
                                              kl_w_N, ce_w_N, spec.tail, spec.temperature, chunk_size, settings,
                                              spec.jsd_beta)
    return reduced(loss_N, spec.reduction), kl_N
