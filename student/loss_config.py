"""What the student is trained to match (the `loss` part of TrainConfig): torch-free, for the CLI.
student/loss.py computes it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from distill.configs import ConfigError, check_types, option, require
from kernels.temperature_rule import temperature_problem

__all__ = ["LossConfig", "TailMode"]

TailMode = Literal["bucket", "renorm", "unnormalized"]  # kernels.fused_topk_kl.TAIL_MODES (a test holds them equal)


@dataclass
class LossConfig:
    """What the student is trained to match: the teacher's cached top-k (and tail), and or the actual tokens."""

    # How the teacher's mass beyond the top-k counts (kernels/fused_topk_kl.py has the formulas);
    # a sampled cache has no top-k and always trains with its estimator (module docstring).
    # "bucket" is the default: "renorm" never moves the student's mass into the teacher's top-k and
    # learned worst of the three on real data (RESULTS.md, "Quality", bench_kd_vs_ce.py).
    tail: TailMode = option("bucket", "Teacher mass beyond the top-k: bucket (one extra category), renorm or "
                                      "unnormalized.")
    # With tail "bucket" or "unnormalized" it must equal the cache's (student/loss.py's docstring).
    temperature: float | None = option(None, "Distillation temperature (KL scaled by T^2; default: the cache's). "
                                             "Another than the cache's needs --tail renorm.")
    ce_weight: float = option(0.0, "Weight of cross-entropy on the actual tokens; 1.0 = CE only, no teacher.")
    # student/objectives.py: on the rows of a cache of generated text (the student's own samples)
    # jsd: kernels/fused_topk_kl_torch.py (GKD's generalised JSD over the top-k and the tail bucket)
    objective: Literal["forward_kl", "reverse_kl", "jsd"] = option(
        "forward_kl", "forward_kl (the teacher's top-k on every row), reverse_kl (on the rows of a cache of text the "
                      "student generated: a policy-gradient estimate of KL(student || teacher) on its sampled tokens, "
                      "importance-weighted to the sampler; other caches' rows keep forward_kl) or jsd (the generalised "
                      "Jensen-Shannon divergence at --beta on every row, over the top-k and the tail bucket).")
    beta: float = option(0.5, "With --objective jsd: the teacher's share of the mixture, in (0, 1) (near 0 the JSD "
                              "over beta tends to the forward KL; near 1, over 1 - beta, to the reverse).")
    ratio_clip: float | None = option(
        None, "With --objective reverse_kl: truncate the importance ratio student / sampler at this (>= 1; default: "
              "none, unbiased).")

    def __post_init__(self):
        check_types(self)
        require("temperature", self.temperature,
                self.temperature is None or (math.isfinite(self.temperature) and self.temperature > 0),
                "a finite number > 0, or leave it out (the cache's)")
        require("ce_weight", self.ce_weight, 0 <= self.ce_weight <= 1, "in [0, 1]")
        require("beta", self.beta, 0 < self.beta < 1, "in (0, 1) (0 and 1: use --objective forward_kl or reverse_kl)")
        if self.objective == "jsd" and self.tail != "bucket":
            raise ConfigError("tail", f"{self.tail}: --objective jsd needs --tail bucket (the teacher normalised over "
                                      "its top-k and the tail)")
        require("ratio_clip", self.ratio_clip,
                self.ratio_clip is None or (math.isfinite(self.ratio_clip) and self.ratio_clip >= 1),
                "a finite number >= 1, or leave it out (no truncation)")

    def distillation_temperature(self, cache_temperature: float) -> float:
        return cache_temperature if self.temperature is None else self.temperature

    def check_cache_temperature(self, cache_temperature: float, kind: str = "topk") -> None:
        """Refuse a temperature this tail, or a cache of targets `kind` ("topk" | "sampled" |
        "topk+sampled", the manifest's targets.kind), cannot compose with a cache at `cache_temperature`
        (kernels/temperature_rule.py: the rule the loss's kernel checks too), and a sampled cache
        for the JSD objective."""
        if self.objective == "jsd" and kind != "topk":
            raise ConfigError("objective", f"jsd needs a top-k cache; this one holds {kind} targets (their estimate "
                                           "is unbiased for the KL only): use --objective forward_kl")
        problem = temperature_problem(self.tail, self.distillation_temperature(cache_temperature), cache_temperature,
                                      kind)
        if problem is not None:
            raise ConfigError("temperature", problem)
