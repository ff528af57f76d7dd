"""The batched-launch plan cache FOAM and 8-bit AdamW share."""

from __future__ import annotations

from collections import OrderedDict

import torch

from student.optim.shards import local

# Plans an optimizer keeps, the least recently used dropped first. A training step usually sees one
# set of params with grads; the offload runtime's update ring (student/offload_update.py) steps each
# host layer alone in one of its slots, and each gpu-state layer alone, so a step sees one set per
# layer. Rebuilding a plan uploads its tables to the device, and those small copies queue behind the
# ring's layer-sized copies on the copy engine: the update then waits for the next layer's load.
PLANS_KEPT = 512


def current_plan(optimizer: torch.optim.Optimizer, key: tuple):
    """This step's plan of `optimizer` (an object with `_plan`, `_plans` and `_build_plan(key) ->
    plan`, the plan holding `key`, `launches`, `grads` and `fused_params`: the params whose grads
    the launches read, their local shards where FSDP2 shards them): a kept one when `key` (the
    params, which have grads, their addresses, ...) and `_states_signature` are those it was built
    for and the grads still fit its launches (dtype, layout, alignment); else a new one. `_plan`
    is the one returned last."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    plans: OrderedDict = optimizer._plans
    full_key = (key, _states_signature(optimizer, params))
    plan = plans.get(full_key)
    fits = lambda plan: not plan.launches or plan.grads.point_at([local(p.grad) for p in plan.fused_params])
    if plan is None or not fits(plan):
        plan = optimizer._build_plan(key)
        assert fits(plan), "a fresh plan fits the grads it was built from"
        full_key = (key, _states_signature(optimizer, params))  # the build made the missing states
        plans[full_key] = plan
        while len(plans) > PLANS_KEPT:
            plans.popitem(last=False)
    plans.move_to_end(full_key)
    optimizer._plan = plan
    return plan


def _states_signature(optimizer: torch.optim.Optimizer, params: list) -> tuple:
    """What of the states of `params` a plan holds: their tensors' addresses (its tables point at
    them) and the step counts relative to the least (its launches group params of one count)."""
    states = [optimizer.state.get(p, {}) for p in params]
    steps = [state.get("step", 0) for state in states]
    least = min(steps, default=0)
    return (tuple(local(v).data_ptr() for state in states for v in state.values() if isinstance(v, torch.Tensor)),
            tuple(step - least for step in steps))


def forget_plans(optimizer: torch.optim.Optimizer) -> None:
    """Drop every kept plan (the states were replaced, e.g. by load_state_dict)."""
    optimizer._plan = None
    optimizer._plans = OrderedDict()
