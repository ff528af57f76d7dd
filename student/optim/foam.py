"""FOAM: Adam with both moments folded into block means along the last dimension.

Source: Wen et al., "FOAM: Blocked State Folding for Memory-Efficient LLM Training",
arXiv 2512.07112, and the authors' code (github.com/zqOuO/FOAM, ``foam_torch/foam_adam.py``).
Where paper and code differ, this follows the code. A folded parameter [..., n] at level l keeps
both moments as means over blocks of b = 2**l adjacent columns, [..., ceil(n / b)] fp32, and
adds back the within-block residual of the current gradient at every step; kernels/foam_step.py
states the update and holds the step (torch reference and Triton kernel).

Discrepancy: third-party write-ups of the paper update v with the square of the block mean of
g, A(g)**2; the released code uses the block mean of g**2, A(g * g), so the folded v already
holds the within-block variance and the residual's square comes on top. We follow the code (it
produced the reported curves).

Parameters with ndim >= 2 in a group whose ``level`` is >= 1 are folded (leading dims flattened
as rows). Groups with level None or 0, and 1-D params in any group, take plain Adam in the same
bias-correction form (eps added to sqrt(v), bias corrections folded into the step size) with
scale 1. (Folding at level 0 is Adam, R = 0; the released code would still multiply a level-0
group by ``scale``, here ``scale`` reaches folded params only, as the project's API asks.)

The optimizer launches the Triton step once per group of tensors that share a param group,
dtypes, block and step count (a few launches a step), through address tables built once while
the parameter set is unchanged (kernels/multi_tensor.py); a step syncs nothing with the host.
Differences from the released code: moments are fp32 for any param dtype and bf16 params are
rounded once per step (the code rounds after the update and again after weight decay).
"""

from __future__ import annotations

import math
import warnings
from numbers import Real

import torch

from distill.errors import DistillUserError
from kernels.foam_step import FoamLaunch, FoamStepSettings, foam_launch_key, foam_moment_shape, foam_step
from kernels.multi_tensor import TRITON_DTYPE_NAMES, GradTable, triton_can_run
from student.optim.plans import PlanCache
from student.optim.shards import like, local

try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None

__all__ = ["FOAM", "foam_param_groups", "foam_state_bytes_formula", "MAX_LEVEL"]

MAX_LEVEL = 16  # block of 65,536 columns: far past any useful fold (the paper's largest is 8)
_ADAM_MATRIX_NAMES = ("embed_tokens", "lm_head")


# --- validation ----------------------------------------------------------------------------------

def _check_level(level) -> None:
    if level is not None and (not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= MAX_LEVEL):
        raise DistillUserError(
            f"`level` must be None or an int in [0, {MAX_LEVEL}] (block size 2**level), got {level!r}"
        )


def _check_real(name: str, value, low: float, low_inclusive: bool = True, high: float = math.inf) -> None:
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= low if low_inclusive else value > low) and value < high
    if not ok:
        bracket = "[" if low_inclusive else "("
        raise DistillUserError(f"`{name}` must be a finite number in {bracket}{low}, {high}), got {value!r}")


def _check_group(group: dict) -> None:
    """ValueError naming the bad hyperparameter of one param group."""
    _check_level(group["level"])
    _check_real("scale", group["scale"], 0.0, low_inclusive=False)
    _check_real("rho", group["rho"], 0.0)
    _check_real("lr", group["lr"], 0.0)
    _check_real("eps", group["eps"], 0.0)
    _check_real("weight_decay", group["weight_decay"], 0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise DistillUserError(f"`betas` must be a pair (beta1, beta2), got {betas!r}")
    _check_real("betas[0]", betas[0], 0.0, high=1.0)
    _check_real("betas[1]", betas[1], 0.0, high=1.0)


def _block_size(level, param: torch.Tensor) -> int:
    """Columns per folded block for this param; 1 means plain Adam."""
    return 2**level if level and param.ndim >= 2 else 1


def foam_state_bytes_formula(shape, level: int | None) -> int:
    """Bytes of the two fp32 moments FOAM keeps for one param of ``shape`` folded at ``level``."""
    _check_level(level)
    shape = tuple(shape)
    return 2 * 4 * math.prod(foam_moment_shape(shape, 2**level if level and len(shape) >= 2 else 1))


# --- the optimizer -----------------------------------------------------------------------------------

class _Plan:
    """What one ``FOAM.step`` does for a fixed set of params with grads: the batched launches and
    the params left to ``foam_step`` one at a time. Built by ``FOAM._build_plan``, reused while
    ``key`` (the state dict, the groups' levels, which params have grads, the params' addresses)
    holds."""

    def __init__(self, key, launches, fused_params, loose, settings: FoamStepSettings):
        self.key = key
        self.launches = launches  # [(group index, FoamLaunch, the params' states)]
        self.loose = loose  # [(param, group, use_triton)]
        self.fused_params = fused_params  # the params of the launches, in order (DTensors where sharded)
        self.fused_states = [s for _, _, states in launches for s in states]
        self.grads = GradTable([launch for _, launch, _ in launches], settings.align_bytes)


def _hyperparameters(group: dict, block: int, step: int) -> dict:
    """The step's arguments for a param of ``group`` at ``block``: ``scale`` reaches folded params only."""
    beta1, beta2 = group["betas"]
    return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                scale=group["scale"] if block > 1 else 1.0, rho=group["rho"], step=step)


class FOAM(torch.optim.Optimizer):
    """Folded Adam (see the module docstring for the update).

    params: tensors or param groups; each group may set its own ``level`` (None or 0: plain Adam),
    ``scale`` (folded params only), ``rho``, ``lr``, ``betas``, ``eps``, ``weight_decay``.
    fused: None picks the Triton step for fp32/bf16/fp16 CUDA params when Triton is installed,
    the torch path otherwise; True always uses the Triton step (on a CPU only under
    TRITON_INTERPRET=1, for tests); False never. settings: the Triton step's tiling
    (kernels.foam_step.FoamStepSettings; the default is the production path).
    State per param: ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` (fp32, [..., ceil(n / 2**level)]
    for folded params, the param's shape otherwise).

    Params FSDP2 shards by rows (student/distributed.py) step on their local shard: folding runs
    along the last dimension, within rows, so a shard's moments are the rows of the whole param's and
    the step is the one-process step, element for element. The moments are DTensors sharded as their
    param (student/optim/shards.py): a checkpoint resumes at any world size.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, level=2,
                 scale=0.25, rho=1.0, fused=None, settings: FoamStepSettings | None = None):
        if fused not in (None, True, False):
            raise DistillUserError(f"`fused` must be None, True or False, got {fused!r}")
        if fused and triton is None:
            raise DistillUserError("`fused=True` needs the triton package (pip install triton); or pass fused=None")
        if settings is not None and not isinstance(settings, FoamStepSettings):
            raise DistillUserError(f"`settings` must be a FoamStepSettings, got {type(settings).__name__}")
        self.fused = fused
        self.settings = settings or FoamStepSettings()
        self._warned_no_triton = False
        self.plans = PlanCache()  # the batched launches of recent steps (see _Plan)
        betas = tuple(betas) if isinstance(betas, (tuple, list)) else betas  # checked in add_param_group
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, level=level, scale=scale,
                        rho=rho)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._use_triton(p)  # fail now, not at the first step, when fused=True cannot run

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    def _use_triton(self, p: torch.Tensor) -> bool:
        if self.fused is False:
            return False
        if self.fused is None:
            if not p.is_cuda or p.dtype not in TRITON_DTYPE_NAMES:
                return False
            if triton is None:
                if not self._warned_no_triton:
                    warnings.warn("FOAM: triton is not installed, CUDA params use the slower torch path")
                    self._warned_no_triton = True
                return False
            return True
        if p.dtype not in TRITON_DTYPE_NAMES:
            raise DistillUserError(f"`fused=True` takes fp32, bf16 or fp16 params, got {p.dtype}; pass fused=None")
        if not triton_can_run(p.device):
            raise DistillUserError(
                f"`fused=True` needs CUDA params (or TRITON_INTERPRET=1 set before import), got {p.device}; "
                "pass fused=None"
            )
        return True

    def _init_state(self, p: torch.Tensor, block: int, level) -> dict:
        state = self.state[p]
        shape = foam_moment_shape(p.shape, block)
        if not state:
            local_shape = foam_moment_shape(local(p).shape, block)
            state["step"] = 0
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = like(p, torch.zeros(local_shape, dtype=torch.float32, device=p.device), shape)
        elif tuple(state["exp_avg"].shape) != shape:
            raise DistillUserError(
                f"FOAM state of a param of shape {tuple(p.shape)} has moments of shape "
                f"{tuple(state['exp_avg'].shape)}, but level {level} needs {shape}; a group's level cannot "
                "change once it has stepped"
            )
        return state

    def _plan_key(self, params: list[torch.Tensor]) -> tuple:
        return (id(self.state), tuple(group["level"] for group in self.param_groups),
                tuple(p.grad is not None for p in params), tuple(local(p).data_ptr() for p in params))

    def _build_plan(self, key: tuple) -> _Plan:
        """Initialise missing states, check the levels, sort the params with grads into launches
        (one per param group, launch key and step count) and the per-tensor rest."""
        by_key, loose = {}, []
        for group_index, group in enumerate(self.param_groups):
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise DistillUserError("FOAM does not support sparse gradients")
                block = _block_size(group["level"], p)
                state = self._init_state(p, block, group["level"])
                use_triton = self._use_triton(p)
                p_local, grad = local(p), local(grad)
                if use_triton and p_local.numel() > 0 and p_local.is_contiguous() and grad.is_contiguous():
                    launch_key = foam_launch_key(p_local, grad, local(state["exp_avg"]), local(state["exp_avg_sq"]),
                                                 block, self.settings)
                    by_key.setdefault((group_index, state["step"], launch_key), []).append((p, state))
                else:
                    loose.append((p, group, use_triton))
        launches, fused_params = [], []
        for (group_index, _, (_, grad_dtype, block, _, aligned, _)), members in by_key.items():
            states = [state for _, state in members]
            launch = FoamLaunch([local(p) for p, _ in members], [local(s["exp_avg"]) for s in states],
                                [local(s["exp_avg_sq"]) for s in states], block=block, grad_dtype=grad_dtype,
                                aligned=aligned, settings=self.settings)
            launches.append((group_index, launch, states))
            fused_params += [p for p, _ in members]
        return _Plan(key, launches, fused_params, loose, self.settings)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        key = self._plan_key(params)
        plan = self.plans.current(self, key, self._build_plan)
        for state in plan.fused_states:
            state["step"] += 1
        for index, (group_index, launch, states) in enumerate(plan.launches):
            group = self.param_groups[group_index]
            launch.run(plan.grads.for_launch(index), **_hyperparameters(group, launch.block, states[0]["step"]))
        for p, group, use_triton in plan.loose:
            block = _block_size(group["level"], p)
            state = self.state[p]
            state["step"] += 1
            foam_step([local(p)], [local(p.grad)], [local(state["exp_avg"])], [local(state["exp_avg_sq"])],
                      block=block, impl="triton" if use_triton else "torch", settings=self.settings,
                      **_hyperparameters(group, block, state["step"]))
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every float state tensor to its param's dtype; FOAM's moments stay
        fp32, so they are taken again from ``state_dict`` after the torch load."""
        super().load_state_dict(state_dict)
        self.plans.forget()
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for param_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(param_id)
            if saved is None:
                continue
            if not {"step", "exp_avg", "exp_avg_sq"} <= saved.keys():
                raise DistillUserError(
                    f"not a FOAM state dict: a param's state has keys {sorted(saved)}, FOAM needs step, "
                    "exp_avg and exp_avg_sq; load the state this optimizer saved, or start without one"
                )
            for key in ("exp_avg", "exp_avg_sq"):
                self.state[p][key] = saved[key].to(device=p.device, dtype=torch.float32, copy=True)
        for group in self.param_groups:
            _check_group(group)



def foam_param_groups(model: torch.nn.Module, *, weight_decay: float, level: int | None, scale: float = 0.25,
                      fold_embeddings: bool = False) -> list[dict]:
    """Param groups for ``FOAM``, as the paper's code builds them.

    Trainable matrices (ndim >= 2) are folded at ``level`` with ``weight_decay`` and ``scale``,
    except those whose name contains "embed_tokens" or "lm_head", which take plain Adam with
    ``weight_decay`` (or are folded too when ``fold_embeddings``); 1-D params (norms, biases) take
    plain Adam without weight decay. A tied lm-head is the embedding param and counted once.
    Empty groups are left out; each group carries a ``name`` for logging."""
    _check_level(level)
    _check_real("scale", scale, 0.0, low_inclusive=False)
    _check_real("weight_decay", weight_decay, 0.0)
    folded, embeddings, no_decay = [], [], []
    for name, p in model.named_parameters():  # yields a shared (tied) tensor once
        if not p.requires_grad:
            continue
        if p.ndim < 2:
            no_decay.append(p)
        elif not fold_embeddings and any(key in name for key in _ADAM_MATRIX_NAMES):
            embeddings.append(p)
        else:
            folded.append(p)
    groups = [
        dict(name="folded", params=folded, level=level, scale=scale, weight_decay=weight_decay),
        dict(name="embeddings", params=embeddings, level=None, weight_decay=weight_decay),
        dict(name="no_decay", params=no_decay, level=None, weight_decay=0.0),
    ]
    return [group for group in groups if group["params"]]
