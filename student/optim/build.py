"""Making the optimizer an `OptimizerConfig` names, and measuring what it holds."""

from __future__ import annotations

import torch

from student.optim.adam8bit import AdamW8bit
from student.optim.config import OptimizerConfig
from student.optim.foam import FOAM, foam_param_groups

__all__ = ["BETAS", "EPS", "build_optimizer", "load_state_keeping_settings", "state_bytes"]

BETAS = (0.9, 0.95)  # the same for all three optimizers
EPS = 1e-8


def build_optimizer(model, config: OptimizerConfig, device: str):
    """AdamW, FOAM or 8-bit AdamW over `model`'s parameters; weight decay on matrices only.
    `device` is a resolved device string (torch's AdamW runs fused on CUDA)."""
    if config.optimizer == "foam":
        groups = foam_param_groups(model, weight_decay=config.weight_decay, level=config.foam_level,
                                   scale=config.foam_scale, fold_embeddings=config.foam_fold_embeddings)
        return FOAM(groups, lr=config.lr, betas=BETAS, eps=EPS)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if config.optimizer == "adamw8bit":
        return AdamW8bit(groups, lr=config.lr, betas=BETAS, eps=EPS)
    fused = {"fused": True} if device.startswith("cuda") else {}
    return torch.optim.AdamW(groups, lr=config.lr, betas=BETAS, eps=EPS, **fused)


def load_state_keeping_settings(optimizer, state: dict) -> None:
    """Load a saved optimizer state (moments, step counts) but keep the hyperparameters the
    optimizer was built with (lr, weight decay, FOAM's scale, ...): a resumed run may change them."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, kept in zip(optimizer.param_groups, settings):
        group.update(kept)


def state_bytes(optimizer) -> int:
    """Bytes held by every tensor in ``optimizer.state`` (moments, scales, step counters)."""
    return sum(
        value.numel() * value.element_size()
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )
