"""The optimizer settings of stage two (torch-free: the CLI imports it for its option defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from distill.configs import check_types, require

OptimizerName = Literal["adamw", "foam", "adamw8bit"]


@dataclass
class OptimizerConfig:
    """Which optimizer, and its hyperparameters; `build_optimizer` (student/optim) makes it."""

    optimizer: OptimizerName = "adamw"  # "adamw" | "foam" (block-folded states) | "adamw8bit" (block-wise 8-bit states)
    lr: float = 3e-4  # peak learning rate (linear warmup, then cosine: student/schedule.py)
    weight_decay: float = 0.1  # decoupled decay on matrices (not on norms and biases)
    clip_grad: float = 1.0  # max global gradient norm (0: no clipping)
    foam_level: int = 2  # FOAM: moments folded into blocks of 2**foam_level along each matrix's last dim
    foam_scale: float = 0.25  # FOAM: the update scale alpha of folded matrices (the authors' default)
    foam_fold_embeddings: bool = False  # FOAM: fold the embedding / lm-head too (else plain Adam)

    def __post_init__(self):
        check_types(self)
        require("lr", self.lr, self.lr > 0, "> 0")
        require("weight_decay", self.weight_decay, self.weight_decay >= 0, ">= 0")
        require("clip_grad", self.clip_grad, self.clip_grad >= 0, ">= 0 (0: no clipping)")
        require("foam_level", self.foam_level, 0 <= self.foam_level <= 12, "an integer in [0, 12]")
        require("foam_scale", self.foam_scale, self.foam_scale > 0, "> 0")
