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

torch and the kernel are imported inside `distill_loss`: the CLI imports `LossConfig` for its
option defaults without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from distill.configs import ConfigError, check_types, require

TailMode = Literal["bucket", "renorm", "unnormalized"]  # kernels.fused_topk_kl.TAIL_MODES (a test holds them equal)


@dataclass
class LossConfig:
    """What the student is trained to match: the teacher's cached top-k (and tail), and or the actual tokens."""

    # How the teacher's mass beyond the top-k counts (kernels/fused_topk_kl.py has the formulas);
    # a sampled cache has no top-k and always trains with its estimator (module docstring).
    # "bucket" is the default: "renorm" never moves the student's mass into the teacher's top-k and
    # learned worst of the three on real data (RESULTS.md, KD vs CE, bench_kd_vs_ce.py).
    tail: TailMode = "bucket"
    # Temperature of the distillation (KL scaled by T^2); None: the cache's temperature. With tail
    # "bucket" or "unnormalized" it must equal the cache's (see the module docstring).
    temperature: float | None = None
    ce_weight: float = 0.0  # weight of next-token cross-entropy; 1.0 is the CE-only baseline (no teacher)

    def __post_init__(self):
        check_types(self)
        require("temperature", self.temperature,
                self.temperature is None or (math.isfinite(self.temperature) and self.temperature > 0),
                "None (the cache's) or a number > 0")
        require("ce_weight", self.ce_weight, 0 <= self.ce_weight <= 1, "in [0, 1]")

    def distillation_temperature(self, cache_temperature: float) -> float:
        return cache_temperature if self.temperature is None else self.temperature

    def check_cache_temperature(self, cache_temperature: float, kind: str = "topk") -> None:
        """Refuse a temperature this tail, or a cache of targets `kind` ("topk" | "sampled" |
        "topk+sampled", the manifest's targets.kind), cannot compose with a cache at `cache_temperature`."""
        temperature = self.distillation_temperature(cache_temperature)
        if kind != "topk" and temperature != cache_temperature:
            raise ConfigError("temperature", (
                f"is {temperature:g} but the cache holds ids sampled from the teacher at temperature "
                f"{cache_temperature:g}, and sampled targets estimate the teacher only at the temperature they were "
                f"drawn at; leave out --temperature (the cache's), or sample a cache at temperature {temperature:g} "
                f"(distill cache-teacher --targets {kind} --temperature {temperature:g})"))
        if self.tail != "renorm" and temperature != cache_temperature:
            raise ConfigError("temperature", (
                f"is {temperature:g} but the cache holds the teacher at temperature {cache_temperature:g}, and the "
                f"{self.tail!r} tail cannot re-temper the cached tail mass; cache the teacher at temperature "
                f"{temperature:g} (distill cache-teacher --temperature {temperature:g}), or use the 'renorm' tail "
                "(--tail renorm), which composes exactly"))


def distill_loss(hidden_ND, weight_VD, batch, config: LossConfig, *, cache_temperature: float,
                 reduction: str = "mean", check_ids: bool = True, whole: tuple[int, int] | None = None):
    """(loss, kl) of the student `hidden_ND @ weight_VD.T` against `batch`'s cached targets.

    hidden_ND: [N, d] final hidden states; weight_VD: [V, d] lm-head, same dtype and device.
    batch: a student.data.Batch of N rows; with `target_weights` (a sampled cache) the KL is the
    unbiased estimate of the full-vocabulary KL and the tail "unnormalized" whatever config.tail
    says. loss = (1 - ce_weight) T^2 KL + ce_weight CE, with gradients to hidden and weight; kl:
    the KL(teacher || student) term alone at temperature T, detached, reduced as the loss ("mean"
    over the unmasked rows, CE over the rows with a next token, or "sum"). One fused pass: the
    [N, V] logits never exist in full.

    whole: (real rows, rows with a next token) of the micro-batch that `batch` is a part of (a
    chunk of chunk-recurrent training): loss and kl are then this part's share of the micro-
    batch's means, so the parts' values sum to them (reduction must be "mean").
    """
    from kernels.fused_topk_kl import fused_topk_kl

    temperature = config.distillation_temperature(cache_temperature)
    ce_weight, scale = config.ce_weight, None
    if whole is not None:
        # Sums over the part, each term scaled by the whole's count: a ce_weight w' and a factor s with
        # s (1 - w') = (1 - w) / rows and s w' = w / target_rows.
        rows, target_rows = whole
        kl_part, ce_part = (1 - ce_weight) / max(rows, 1), ce_weight / max(target_rows, 1)
        scale, ce_weight, reduction = kl_part + ce_part, ce_part / (kl_part + ce_part), "sum"
    target_weights = getattr(batch, "target_weights", None)  # None for a top-k cache
    tail = config.tail if target_weights is None else "unnormalized"
    loss, kl = fused_topk_kl(hidden_ND, weight_VD, batch.topk_ids, batch.topk_logprobs, batch.tail_logmass,
                             target_ids=batch.target_ids, mask=batch.mask, tail=tail, temperature=temperature,
                             cache_temperature=cache_temperature, ce_weight=ce_weight, reduction=reduction,
                             impl="auto", check_ids=check_ids, return_kl=True, target_weights=target_weights)
    if scale is not None:
        loss, kl = loss * scale, kl / max(whole[0], 1)
    return loss, kl
