"""Memory-lean optimizers for stage 2 and a helper to measure their state."""

from __future__ import annotations

import torch


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by every tensor in ``optimizer.state`` (moments, scales, step counters)."""
    return sum(
        value.numel() * value.element_size()
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )
