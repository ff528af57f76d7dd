"""The batched-launch plan cache FOAM and 8-bit AdamW share."""

from __future__ import annotations

from collections import OrderedDict

import torch

from student.optim.shards import local

# Plans an optimizer keeps, the least recently used dropped first. A training step usually sees one
# set of params with grads; the offload runtime's update ring (student/offload/update.py) steps each
# host layer alone in one of its slots, and each gpu-state layer alone, so a step sees one set per
# layer. Rebuilding a plan uploads its tables to the device, and those small copies queue behind the
# ring's layer-sized copies on the copy engine: the update then waits for the next layer's load.
PLANS_KEPT = 512


class PlanCache:
    """The batched-launch plans of one optimizer (FOAM and 8-bit AdamW each keep one), the least
    recently used dropped past PLANS_KEPT. A plan holds `key`, `launches`, `grads` and
    `fused_params` (the params whose grads the launches read, their local shards where FSDP2 shards
    them). `last` is the plan `current` returned last (None before a step and after `forget`)."""

    def __init__(self):
        self.forget()

    def __len__(self) -> int:
        """The plans kept."""
        return len(self._kept)

    def forget(self) -> None:
        """Drop every kept plan (the states were replaced, e.g. by load_state_dict)."""
        self.last = None
        self._kept: OrderedDict = OrderedDict()

    def current(self, optimizer: torch.optim.Optimizer, key: tuple, build):
        """This step's plan of `optimizer` (its param_groups and state are read): a kept one when
        `key` (the params, which have grads, their addresses, ...) and `_states_signature` are those
        it was built for and the grads still fit its launches (dtype, layout, alignment); else a new
        one, `build(key)` (which makes the missing states), kept."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        plans = self._kept
        full_key = (key, _states_signature(optimizer, params))
        plan = plans.get(full_key)
        fits = lambda plan: not plan.launches or plan.grads.point_at([local(p.grad) for p in plan.fused_params])
        if plan is None or not fits(plan):
            plan = build(key)
            assert fits(plan), "a fresh plan fits the grads it was built from"
            full_key = (key, _states_signature(optimizer, params))  # the build made the missing states
            plans[full_key] = plan
            while len(plans) > PLANS_KEPT:
                plans.popitem(last=False)
        plans.move_to_end(full_key)
        self.last = plan
        return plan


def _states_signature(optimizer: torch.optim.Optimizer, params: list) -> tuple:
    """What of the states of `params` a plan holds: their tensors' addresses (its tables point at
    them) and the step counts relative to the least (its launches group params of one count)."""
    states = [optimizer.state.get(p, {}) for p in params]
    steps = [state.get("step", 0) for state in states]
    least = min(steps, default=0)
    return (tuple(local(v).data_ptr() for state in states for v in state.values() if isinstance(v, torch.Tensor)),
            tuple(step - least for step in steps))
