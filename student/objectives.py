"""On-policy distillation's reverse-KL objective on the student's own sampled text, as a surrogate loss.

Setting. The student q_θ wrote completions earlier with a sampler μ (the student at sampling time:
possibly an older θ, a temperature, a top-p nucleus: pipelines/generate records log μ of each
token it drew); the teacher p scored them offline (a cache's `target_logprob`, valid as long as
the teacher does not change: Lightning OPD's premise). At training time each completion row holds
the realized next token x, log p(x), log μ(x), and the student's log q_θ(x) = -CE_row, the per-row
cross-entropy at temperature 1 that ``fused_topk_kl(..., ce_weight=1.0, reduction="none")``
returns. q is the student at temperature 1: the policy being distilled, whatever μ sampled with.

Math, per position (the prefix fixed):
  reverse KL       KL(q || p) = E_{x~q}[log q(x) - log p(x)]
  its gradient     ∇KL = E_{x~q}[(log q(x) - log p(x)) ∇log q(x)]   (score-function form)
      (differentiating q inside the log adds E_q[∇log q] = ∇ sum_x q(x) = 0, so that term drops, and
      for the same reason no baseline is needed for the estimate to be unbiased.)
  from samples of μ    ∇KL = E_{x~μ}[w (log q - log p) ∇log q],  w = q(x) / μ(x), detached,
      unbiased wherever μ(x) > 0 on q's support. A top-p sampler breaks that: tokens outside its
      nucleus are never drawn, so the estimate misses q's mass there (E_μ[w] = q(nucleus) < 1;
      the `mean_ratio` statistic shows it).
  surrogate        L = sum_rows sg(w (log q(x) - log p(x))) · log q(x)   (sg: stop-gradient)
      whose gradient is the estimate above. The sign: L's gradient is +∇KL, so descending L lowers
      log q(x) where the student over-weights x (log q > log p) and raises it where it
      under-weights x. In RL terms the advantage is log p - log q (Thinking Machines' negative
      reverse KL) and L = -sum sg(w · advantage) log q. The value of L itself means nothing, so
      the returned loss adds a constant, sg(k)(1 - log q) with k = w (log q - log p): its value is
      sum_rows k, the importance-weighted reverse-KL estimate, its gradient that of L.

Discount 0. A row's coefficient is its own token's log-ratio only, not the sum of the later
tokens' (the return of RL; MiniLLM sums them with a discount): as Thinking Machines' on-policy
distillation does, each position is a one-step problem. The sum over a completion then estimates
sum_t E_{prefix}[KL(q(.|prefix_t) || p(.|prefix_t))], each position's reverse KL given its sampled
prefix, and the gradient ignores how the prefix's own distribution depends on θ (as those works
do). The ratio is the token's own, not the product over the prefix: off-policy, the prefixes are
μ's and are not reweighted (the exact correction, that product, has a variance that grows with
the length).

The log-ratio is recomputed under the current student at training time (log q from this step's
logits, not the sampler's log μ): AsyncOPD reports reverse KL is not robust to stale rollouts
unless its signal is, and w corrects the rest of the staleness.

Clipping: truncated importance sampling, w -> min(w, c) (``ratio_clip``). It bounds one row's
weight, lowering the variance, at a bias only where it bites (w > c: tokens the current student
likes far more than the sampler did). The alternative, PPO's clip (MiniLLM's loss uses it:
max(-A w, -A clip(w, 1 - ε, 1 + ε)) per token), is a trust region for several optimiser steps on
one batch relative to the policy that sampled it: it drops a token's gradient entirely once its
ratio leaves the range in the direction the advantage favours. Here a batch of rollouts is used
for one step under a stale or tempered sampler, where the ratio is a correction, not a step size,
so truncation keeps every token's gradient and only caps its weight. Thinking Machines' on-policy
distillation runs on Tinker's `importance_sampling` policy loss, -ratio · advantage with the
ratio unclipped (ratio_clip None here). Truncated weights are what IMPALA's V-trace uses, and the
truncated-IS correction of sampler/trainer mismatch in RL for LLMs (Yao et al. 2025; RPG's clip,
arXiv 2505.17508). c >= 1, so a row on-policy (w = 1) is never clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["REDUCTIONS", "ReverseKLStats", "reverse_kl_surrogate"]

REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class ReverseKLStats:
    """What a reverse-KL step saw, over its rows: detached 0-dim float tensors, so that logging them
    costs no device sync until it reads them (``as_floats``)."""

    # The mean over rows of k = min(w, c) (log q(x) - log p(x)): the loss's value with reduction
    # "mean". On-policy (w = 1) it is the plain per-token reverse-KL estimate on the student's own
    # samples; off-policy the importance-weighted estimate of the current student's, biased only
    # where clipping bites (clipped_share). Not the unweighted mean of log q - log p, which under
    # μ != q is an expectation of the current student's log-ratio under another distribution, no KL.
    reverse_kl: torch.Tensor
    # The mean of the unclipped ratio w = q(x) / μ(x): 1 in expectation when μ covers q's support;
    # below 1 by q's mass outside a top-p nucleus; its spread grows as the sampler goes stale.
    mean_ratio: torch.Tensor
    # The share of rows whose ratio exceeded ratio_clip (0 with ratio_clip None).
    clipped_share: torch.Tensor
    # The number of rows counted.
    num_rows: torch.Tensor

    def as_floats(self) -> dict[str, float]:
        """The statistics as Python floats (a device sync), by field name."""
        return {"reverse_kl": float(self.reverse_kl), "mean_ratio": float(self.mean_ratio),
                "clipped_share": float(self.clipped_share), "num_rows": float(self.num_rows)}


def reverse_kl_surrogate(
    ce_rows: torch.Tensor,
    teacher_logprob: torch.Tensor,
    sampler_logprob: torch.Tensor,
    rows: torch.Tensor,
    *,
    ratio_clip: float | None,
    reduction: str = "mean",
    check_values: bool = True,
) -> tuple[torch.Tensor, ReverseKLStats]:
    """(loss, stats): the surrogate of the module docstring, whose gradient is the (truncated)
    importance-weighted estimate of the gradient of the student's per-token reverse KL to the teacher.

    ce_rows: float [N], -log q(x) per row, with the graph to the student (``fused_topk_kl`` with
    ce_weight=1.0, reduction="none"; any value on rows outside ``rows``). teacher_logprob: float [N],
    log p(x) (``Batch.target_logprob``; NaN allowed outside ``rows``). sampler_logprob: float [N],
    log μ(x), the log-probability the sampler drew x with; NaN on a row means ratio 1: the row is
    on-policy, drawn by the current student itself at temperature 1 and no nucleus. rows: bool [N],
    the completion rows with a next token; the others contribute nothing to the loss, its gradient
    or the stats. ratio_clip: c >= 1, the truncation w -> min(w, c), or None for none.
    reduction: "mean" over ``rows`` (0 with none), "sum", or "none" (per row [N], 0 outside
    ``rows``). check_values: refuse a row of ``rows`` whose teacher log-prob is not finite or whose
    sampler log-prob is infinite (a device sync on a GPU).

    Returns the loss (in ce_rows's dtype promoted to at least fp32; its value is the reduced
    k = min(w, c) (log q - log p), its gradient flows to ce_rows only) and a ``ReverseKLStats``.
    """
    _check(ce_rows, teacher_logprob, sampler_logprob, rows, ratio_clip, reduction, check_values)
    acc = torch.promote_types(ce_rows.dtype, torch.float32)
    ce_N = torch.where(rows, ce_rows.to(acc), 0.0)  # outside rows: no value, no gradient, no NaN
    logq_N = -ce_N.detach()
    logp_N = torch.where(rows, teacher_logprob.to(acc), 0.0)
    log_mu_N = sampler_logprob.to(acc)
    # NaN (on-policy) and rows outside `rows`: log μ = log q, so w = 1 there.
    log_mu_N = torch.where(rows & ~torch.isnan(log_mu_N), log_mu_N, logq_N)
    ratio_N = torch.exp(logq_N - log_mu_N)
    weight_N = ratio_N if ratio_clip is None else ratio_N.clamp_max(ratio_clip)
    k_N = weight_N * (logq_N - logp_N)  # 0 outside rows, where log q and log p are 0
    # Value k (the estimate), gradient k ∇log q = -k ∇CE: ce's detached copy cancels ce's value.
    loss_N = k_N * (1.0 + ce_N.detach() - ce_N)

    num_rows = rows.sum()
    divisor = num_rows.clamp_min(1).to(acc)
    clipped = torch.zeros((), dtype=acc, device=ce_rows.device) if ratio_clip is None else \
        (ratio_N > ratio_clip).sum().to(acc) / divisor
    stats = ReverseKLStats(reverse_kl=k_N.sum() / divisor, mean_ratio=torch.where(rows, ratio_N, 0.0).sum() / divisor,
                           clipped_share=clipped, num_rows=num_rows.to(acc))
    if reduction == "none":
        return loss_N, stats
    loss = loss_N.sum()
    return (loss / divisor if reduction == "mean" else loss), stats


def _check(ce_rows, teacher_logprob, sampler_logprob, rows, ratio_clip, reduction, check_values) -> None:
    """The arguments' shapes, dtypes, devices and settings; with check_values, the rows' values."""
    if ce_rows.dim() != 1:
        raise ValueError(f"ce_rows must be a 1-D float tensor [N] (one cross-entropy a row), got shape "
                         f"{tuple(ce_rows.shape)}")
    num_rows, device = ce_rows.shape[0], ce_rows.device
    for name, t in (("ce_rows", ce_rows), ("teacher_logprob", teacher_logprob), ("sampler_logprob", sampler_logprob)):
        if t.shape != (num_rows,):
            raise ValueError(f"{name} must have shape ({num_rows},) like ce_rows, got {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} must be on {device} like ce_rows, got {t.device}")
    if rows.shape != (num_rows,) or rows.dtype != torch.bool or rows.device != device:
        raise ValueError(f"rows must be a bool tensor of shape ({num_rows},) on {device}, got {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device}")
    if ratio_clip is not None and (isinstance(ratio_clip, bool) or not isinstance(ratio_clip, (int, float))
                                   or not (math.isfinite(ratio_clip) and ratio_clip >= 1)):
        raise ValueError(f"ratio_clip must be None or a finite number >= 1 (below 1 it would shrink on-policy rows, "
                         f"whose ratio is 1), got {ratio_clip!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if check_values:
        bad_teacher = rows & ~torch.isfinite(teacher_logprob)
        if bool(bad_teacher.any()):
            row = int(bad_teacher.nonzero()[0])
            raise ValueError(f"teacher_logprob must be finite on every row of rows, got {float(teacher_logprob[row])} "
                             f"at row {row}; a row without a teacher score belongs outside rows")
        bad_sampler = rows & torch.isinf(sampler_logprob)
        if bool(bad_sampler.any()):
            row = int(bad_sampler.nonzero()[0])
            raise ValueError(f"sampler_logprob must be finite or NaN (on-policy) on every row of rows, got "
                             f"{float(sampler_logprob[row])} at row {row}")
