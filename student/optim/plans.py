"""The batched-launch plan cache FOAM and 8-bit AdamW share."""

from __future__ import annotations

import torch

from student.optim.shards import local


def current_plan(optimizer: torch.optim.Optimizer, key: tuple):
    """This step's plan of `optimizer` (an object with `_plan` and `_build_plan(key) -> plan`, the
    plan holding `key`, `launches`, `grads` and `fused_params`: the params whose grads the launches read,
    their local shards where FSDP2 shards them): the cached one, rebuilt when `key`
    (the params, which have grads, their addresses, ...) changed or when a grad no longer fits its
    launch (another dtype, layout or alignment)."""
    plan = optimizer._plan
    fits = lambda plan: not plan.launches or plan.grads.point_at([local(p.grad) for p in plan.fused_params])
    if plan is None or plan.key != key or not fits(plan):
        plan = optimizer._plan = optimizer._build_plan(key)
        assert fits(plan), "a fresh plan fits the grads it was built from"
    return plan
