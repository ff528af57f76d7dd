"""The distillation loss of stage two, one function for training and evaluation.

`distill_loss` hands the final hidden states, the lm-head and a batch's cached targets to
kernels.fused_topk_kl (the KL exists only there: its dense reference and fused paths). The cached
log-probabilities are the teacher's at the cache's temperature (the manifest's
targets.temperature); `LossConfig.temperature` is the temperature of the distillation. With the
"renorm" tail any pair composes exactly; "bucket" and "unnormalized" use the cached tail mass,
which cannot be re-tempered (it is one number for many tokens), so they train only at the
cache's temperature, where the loss's optimum is the teacher itself.

A sampled or hybrid cache (manifest targets.kind "sampled" or "topk+sampled") carries per-slot
weights instead of a top-k (`Batch.target_weights`): the loss is then the unbiased estimate of
the full-vocabulary KL, the "unnormalized" formulas with the weights as the teacher's mass,
whatever `LossConfig.tail` says, and only at the temperature the cache was sampled at.

With ``objective="reverse_kl"`` the rows of a cache of generated text (a finite
`Batch.sampler_logprob`: the student's own sampled tokens) train on the reverse-KL surrogate of
student/objectives.py instead of the forward KL, from the same pass's per-row cross-entropy; other
rows (a static cache mixed in) keep the forward KL. The cross-entropy mix applies to all rows alike.
With ``objective="jsd"`` the generalised JSD at ``beta`` takes the forward KL's place on every KL
row, in the same fused pass (top-k caches with the bucket tail only; kl is then the JSD).

The config is student/loss_config.py's (torch-free, for the CLI).
"""

from __future__ import annotations

import torch

import kernels.fused_topk_kl as fused
from student.loss_config import LossConfig

__all__ = ["LossConfig", "distill_loss"]


def distill_loss(hidden_ND, weight_VD, batch, config: LossConfig, *, cache_temperature: float,
                 reduction: str = "mean", check_ids: bool = True, whole: tuple[int, int] | None = None):
    """(loss, kl) of the student `hidden_ND @ weight_VD.T` against `batch`'s cached targets.

    hidden_ND: [N, d] final hidden states; weight_VD: [V, d] lm-head, same dtype and device.
    batch: a student.data.Batch of N rows; with `target_weights` (a sampled cache) the KL is the
    unbiased estimate of the full-vocabulary KL and the tail "unnormalized" whatever config.tail
    says. loss = (1 - ce_weight) T^2 KL + ce_weight CE, with gradients to hidden and weight; kl:
    the KL(teacher || student) term alone at temperature T, detached, reduced as the loss ("mean"
    over the KL rows, CE over the rows with a next token, or "sum"). The KL rows are
    `batch.kd_rows`: every unmasked row, or a cross-tokenizer batch's aligned ones, whose other rows
    train on CE alone at full weight (_with_unaligned_ce). One fused pass (two for a
    cross-tokenizer batch with unaligned rows): the [N, V] logits never exist in full.

    whole: (KL rows, rows with a next token) of the micro-batch that `batch` is a part of (a
    chunk of chunk-recurrent training): loss and kl are then this part's share of the micro-
    batch's means, so the parts' values sum to them (reduction must be "mean").
    """
    temperature = config.distillation_temperature(cache_temperature)
    target_weights = getattr(batch, "target_weights", None)  # None for a top-k cache
    tail = config.tail if target_weights is None else "unnormalized"
    kd_mask = getattr(batch, "kd_mask", None)
    term = lambda rows, ce_weight, reduction_, hidden=hidden_ND, select=None, impl="auto": fused.fused_topk_kl(
        hidden, weight_VD, *(t if select is None else t[select] for t in (batch.topk_ids, batch.topk_logprobs,
                                                                        batch.tail_logmass)),
        target_ids=batch.target_ids if select is None else batch.target_ids[select], mask=rows, tail=tail,
        temperature=temperature, cache_temperature=cache_temperature, ce_weight=ce_weight, reduction=reduction_,
        impl=impl, check_ids=check_ids, return_kl=True, jsd_beta=config.beta if config.objective == "jsd" else None,
        target_weights=target_weights if select is None or target_weights is None else target_weights[select])
    kd_rows = batch.mask if kd_mask is None else batch.mask & kd_mask
    sampler = getattr(batch, "sampler_logprob", None)
    if config.objective == "reverse_kl" and sampler is not None:
        return _with_reverse_kl(term, batch, kd_rows, config, temperature, reduction, whole)
    if kd_mask is not None and bool((batch.mask & (batch.target_ids >= 0) & ~kd_rows).any()):
        return _with_unaligned_ce(term, hidden_ND, batch, kd_rows, config.ce_weight, reduction, whole)
    ce_weight, scale = config.ce_weight, None
    if whole is not None:
        # Sums over the part, each term scaled by the whole's count: a ce_weight w' and a factor s with
        # s (1 - w') = (1 - w) / rows and s w' = w / target_rows.
        rows, target_rows = whole
        kl_part, ce_part = (1 - ce_weight) / max(rows, 1), ce_weight / max(target_rows, 1)
        scale, ce_weight, reduction = kl_part + ce_part, ce_part / (kl_part + ce_part), "sum"
    loss, kl = term(kd_rows, ce_weight, reduction)
    if scale is not None:
        loss, kl = loss * scale, kl / max(whole[0], 1)
    return loss, kl


def _with_reverse_kl(term, batch, kd_rows, config: LossConfig, temperature: float, reduction: str, whole):
    """objective reverse_kl (module doc): (1 - w) (T^2 sum of the forward KL over the other KL rows +
    sum of the reverse-KL surrogate over the sampled rows) / KL rows + w sum CE / rows with a next
    token; kl: the forward KL and reverse-KL estimates summed over their rows, over the KL rows.
    The per-row cross-entropy comes from the torch path (the Triton path returns no per-row
    gradient), one pass over every row with a next token."""
    from student.objectives import reverse_kl_surrogate

    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction {reduction!r} is not defined for the reverse-KL objective")
    has_next = batch.mask & (batch.target_ids >= 0)
    sampled = kd_rows & ~torch.isnan(batch.sampler_logprob)
    others = kd_rows & ~sampled
    rows, target_rows = whole if whole is not None else (int(kd_rows.sum()), int(has_next.sum()))
    if reduction == "sum" and whole is None:
        rows = target_rows = 1
    ce_rows, _ = term(has_next, 1.0, "none", impl="torch")
    surrogate, stats = reverse_kl_surrogate(ce_rows, batch.target_logprob, batch.sampler_logprob, sampled,
                                            ratio_clip=config.ratio_clip, reduction="sum")
    w = config.ce_weight
    loss = (1 - w) * surrogate / max(rows, 1) + w * ce_rows.sum() / max(target_rows, 1)
    kl_sum = stats.reverse_kl * stats.num_rows
    if bool(others.any()):
        forward, kl = term(others, 0.0, "sum")
        loss, kl_sum = loss + (1 - w) * forward / max(rows, 1), kl_sum + kl
    return loss, kl_sum.detach() / max(rows, 1)


def _with_unaligned_ce(term, hidden_ND, batch, kd_rows, ce_weight: float, reduction: str, whole):
    """A cross-tokenizer batch: (1 - w) T^2 KL + w CE over the aligned rows and CE alone over the
    others (positions inside a teacher token have no teacher targets; their own next token is what
    is left), as sums scaled to the means ("mean") of KL over the aligned rows and CE over every row
    with a next token: (1 - w) T^2 mean KL + (w sum_aligned CE + sum_others CE) / rows with a next
    token."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction {reduction!r} is not defined for a cross-tokenizer batch with CE")
    has_next = batch.mask & (batch.target_ids >= 0)
    rows, target_rows = whole if whole is not None else (int(kd_rows.sum()), int(has_next.sum()))
    if reduction == "sum" and whole is None:
        rows = target_rows = 1
    kl_part, ce_part = (1 - ce_weight) / max(rows, 1), ce_weight / max(target_rows, 1)
    scale = kl_part + ce_part
    loss, kl = term(kd_rows, ce_part / scale, "sum")
    loss = loss * scale
    others = torch.nonzero(has_next & ~kd_rows).flatten()
    if len(others):
        ce_loss, _ = term(None, 1.0, "sum", hidden=hidden_ND[others], select=others)
        loss = loss + ce_loss / max(target_rows, 1)
    return loss, kl / max(rows, 1)

