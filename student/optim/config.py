"""The optimizer settings of stage two (torch-free: the CLI imports it for its option defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from distill.configs import check_types, option, require

OptimizerName = Literal["adamw", "foam", "adamw8bit"]


@dataclass
class OptimizerConfig:
    """Which optimizer, and its hyperparameters; `build_optimizer` (student/optim) makes it."""

    optimizer: OptimizerName = option("adamw", "adamw, foam (block-folded states) or adamw8bit (8-bit states).")
    lr: float = option(3e-4, "Peak learning rate (linear warmup, then cosine).")
    weight_decay: float = option(0.1, "Decoupled weight decay on matrices (not on norms and biases).")
    clip_grad: float = option(1.0, "Max global gradient norm (0: no clipping).")
    foam_level: int = option(2, "FOAM: fold moments into blocks of 2**level along each matrix's last dim.")
    # FOAM: the update scale alpha of folded matrices (the authors' default)
    foam_scale: float = option(0.25, "FOAM: update scale of the folded matrices.")
    foam_fold_embeddings: bool = option(False, "FOAM: fold the embedding and lm-head too (else plain Adam).")

    def __post_init__(self):
        check_types(self)
        # isfinite first: nan fails every comparison, but inf passes `> 0` and breaks the first step
        require("lr", self.lr, math.isfinite(self.lr) and self.lr > 0, "a finite number > 0")
        require("weight_decay", self.weight_decay, math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                "a finite number >= 0")
        require("clip_grad", self.clip_grad, math.isfinite(self.clip_grad) and self.clip_grad >= 0,
                "a finite number >= 0 (0: no clipping)")
        require("foam_level", self.foam_level, 0 <= self.foam_level <= 12, "an integer in [0, 12]")
        require("foam_scale", self.foam_scale, math.isfinite(self.foam_scale) and self.foam_scale > 0,
                "a finite number > 0")
