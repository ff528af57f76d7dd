"""AdamW whose two moments live block-wise in 8 bits (bitsandbytes-style block quantisation).

Each parameter's moments are flattened and cut into blocks of `block_size` elements; a block keeps
one fp32 absmax scale and one uint8 code per element (the "dynamic tree" code of Dettmers et al.,
8-bit optimizers via block-wise quantization; kernels/adamw8bit_step.py describes it). A step
dequantises, updates in fp32 exactly as AdamW does, applies the update with the fp32 moments, then
requantises (round to nearest).

- m (first moment) is signed: a sign bit plus a 7-bit magnitude, 255 distinct values.
- v (second moment) is stored as r = sqrt(v) through the unsigned 8-bit code (256 values). Why
  sqrt: the update divides by sqrt(v) + eps, so quantising r puts the code's relative error
  straight on the quantity used, and r spans half the decades v does (v ~ g^2), so far fewer
  entries fall below the code's smallest value and round to 0, the case that would turn
  m / (sqrt(v) + eps) into m / eps. tests/test_adam8bit.py bounds both codes' rounding error and
  the drift from fp32 AdamW, and holds the drift with sqrt(v) stored far below the drift with v
  stored through the same code (test_storing_sqrt_v_drifts_far_less_than_storing_v).

Parameters with fewer than `min_8bit_size` elements (norms, biases) keep fp32 moments and follow
torch.optim.AdamW's single-tensor arithmetic op for op, batched with foreach ops over the params
that share a group and a step count.

The 8-bit step is kernels/adamw8bit_step.py: for CPU params its CPU path (the torch reference on
cache-sized pieces, bit for bit), for CUDA params the torch reference or, when Triton is
installed (`fused`), one Triton kernel that dequantises, updates and
requantises each block in one pass, launched once per group of tensors sharing a param group,
dtypes and step count through address tables built once while the parameter set is unchanged
(kernels/multi_tensor.py).

State per 8-bit parameter of n elements: codes_m, codes_r (uint8 [n]) and absmax_m, absmax_r
(fp32 [ceil(n / block_size)]), i.e. `adam8bit_state_bytes_formula`; the step count is a Python int
(no tensor, no host sync to read it).

Under FSDP2 (student/distributed.py) each rank steps its local shard of a parameter (its rows) as
if the shard were the parameter: the shard's elements are cut into blocks from the shard's first
element. Whether a parameter keeps 8-bit or fp32 moments is decided by its whole size, as in one
process. The blocks are the one-process blocks exactly when every shard starts at a multiple of
`block_size` elements (rows per rank x row length a multiple of it); otherwise a later shard's
blocks are offset from the one-process blocks (the same code and rounding rule over other groups
of elements; tests/test_distributed.py bounds the drift this brings). The states are DTensors
sharded as the parameter: codes of the parameter's shape, absmax [ranks x the largest shard's
blocks] (a smaller shard leaves its tail unused). That layout depends on the world size, so a
sharded run's 8-bit states resume only at the world size that wrote them (student/checkpoint.py
refuses another in one line); the fp32 moments of small parameters have the parameter's layout.
"""

from __future__ import annotations

import math
import warnings

import torch

from distill.errors import DistillUserError
from kernels.adamw8bit_step import (AdamW8bitLaunch, AdamW8bitStepSettings, adamw8bit_launch_key, adamw8bit_step,
                                    adamw_step_scalars)
from kernels.multi_tensor import TRITON_DTYPE_NAMES, GradTable, triton_can_run
from student.optim.plans import PlanCache
from student.optim.shards import is_sharded, largest_shard_numel, like, local

try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None

__all__ = ["AdamW8bit", "adam8bit_state_bytes_formula"]

_STATE_KEYS = ("codes_m", "absmax_m", "codes_r", "absmax_r")


def adam8bit_state_bytes_formula(numel: int, block_size: int, min_8bit_size: int) -> int:
    """Bytes of AdamW8bit moment state for one parameter of `numel` elements (step is not a tensor)."""
    if numel < min_8bit_size:
        return 2 * 4 * numel
    return 2 * (numel + 4 * math.ceil(numel / block_size))


def _check(name: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise DistillUserError(f"`{name}` must be {allowed}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hyperparameters(group: dict, step: int) -> dict:
    beta1, beta2 = group["betas"]
    return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                step=step)


class _Plan:
    """What one ``AdamW8bit.step`` does for a fixed set of params with grads; reused while ``key``
    (the state dict, which params have grads, the params' addresses) holds."""

    def __init__(self, key, launches, fused_params, small, loose, settings: AdamW8bitStepSettings):
        self.key = key
        self.launches = launches  # [(group index, AdamW8bitLaunch, the params' states)]
        self.fused_params = fused_params  # the params of the launches, in order (DTensors where sharded)
        self.small = small  # [(group index, params, states)]: fp32 moments, one step count each
        self.loose = loose  # [(param, state, group, use_triton)]: 8-bit params stepped one at a time
        self.fused_states = [s for _, _, states in launches for s in states]
        self.grads = GradTable([launch for _, launch, _ in launches], settings.align_bytes)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with block-wise 8-bit moments.

    Arguments are torch.optim.AdamW's plus `block_size` (elements per absmax scale) and
    `min_8bit_size` (parameters with fewer elements keep fp32 moments). Parameters may be fp32,
    bf16 or fp16; the arithmetic is fp32 and the result is cast back to the parameter's dtype.
    fused: None picks the Triton step for the 8-bit CUDA params when Triton is installed and the
    kernel takes block_size (``settings.max_block``), the torch path otherwise; True always uses the
    Triton step (on a CPU only under TRITON_INTERPRET=1, for tests); False never. settings: the Triton
    step's tiling (kernels.adamw8bit_step.AdamW8bitStepSettings; the default is the production path).
    """

    name = "adamw8bit"  # its --optimizer name
    # Sharded by FSDP2, the 8-bit states are blocked per rank's shard (module docstring): a checkpoint
    # resumes only at the world size that wrote it (student/checkpoint.py).
    world_size_bound = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, block_size: int = 256,
                 min_8bit_size: int = 4096, fused: bool | None = None,
                 settings: AdamW8bitStepSettings | None = None):
        _check("fused", fused, fused in (None, True, False), "None, True or False")
        if fused and triton is None:
            raise DistillUserError("`fused=True` needs the triton package (pip install triton); or pass fused=None")
        _check("settings", settings, settings is None or isinstance(settings, AdamW8bitStepSettings),
               "None or an AdamW8bitStepSettings")
        self.fused = fused
        self.settings = settings or AdamW8bitStepSettings()
        self._warned: set[str] = set()
        self.plans = PlanCache()  # the batched launches of recent steps (see _Plan)
        _check("lr", lr, isinstance(lr, (int, float)) and lr >= 0, "a number >= 0")
        _check("betas", betas, len(betas) == 2 and all(0 <= b < 1 for b in betas), "two numbers in [0, 1)")
        _check("eps", eps, isinstance(eps, (int, float)) and eps >= 0, "a number >= 0")
        _check("weight_decay", weight_decay, weight_decay >= 0, "a number >= 0")
        _check("block_size", block_size, _is_int(block_size) and block_size >= 1,
               "a positive int (elements per absmax scale, e.g. 256 or 4096)")
        _check("min_8bit_size", min_8bit_size, _is_int(min_8bit_size) and min_8bit_size >= 0, "an int >= 0")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        block_size=block_size, min_8bit_size=min_8bit_size)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._use_triton(p, group)  # fail now, not at the first step, when fused=True cannot run

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            warnings.warn(message)
            self._warned.add(message)

    def _use_triton(self, p: torch.Tensor, group: dict) -> bool:
        if self.fused is False or p.numel() < group["min_8bit_size"]:
            return False
        too_big = not self.settings.takes_block(group["block_size"])
        if self.fused is None:
            if not p.is_cuda or p.dtype not in TRITON_DTYPE_NAMES:
                return False
            if triton is None:
                self._warn_once("AdamW8bit: triton is not installed, CUDA params use the slower torch path")
                return False
            if too_big:
                self._warn_once(f"AdamW8bit: block_size {group['block_size']} is over the kernel's "
                                f"{self.settings.max_block}; those params use the slower torch path")
                return False
            return True
        if p.dtype not in TRITON_DTYPE_NAMES:
            raise DistillUserError(f"`fused=True` takes fp32, bf16 or fp16 params, got {p.dtype}; pass fused=None")
        if not triton_can_run(p.device):
            raise DistillUserError(f"`fused=True` needs CUDA params (or TRITON_INTERPRET=1 set before import), "
                                   f"got {p.device}; pass fused=None")
        if too_big:
            raise DistillUserError(f"`fused=True` takes block_size up to {self.settings.max_block}, got "
                                   f"{group['block_size']}; pass fused=None or a smaller block_size")
        return True

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        state["step"] = 0
        if p.numel() < group["min_8bit_size"]:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            return state
        shard = local(p)
        num_blocks = math.ceil(largest_shard_numel(p) / group["block_size"])
        ranks = p.device_mesh.size() if is_sharded(p) else 1
        for name in ("m", "r"):  # sharded: codes shaped as the param, so that they split over the ranks as its rows
            codes = torch.zeros(shard.shape if is_sharded(p) else shard.numel(), dtype=torch.uint8, device=p.device)
            state[f"codes_{name}"] = like(p, codes, p.shape)
            absmax = torch.zeros(num_blocks, dtype=torch.float32, device=p.device)
            state[f"absmax_{name}"] = like(p, absmax, (ranks * num_blocks,))
        return state

    def _kernel_state(self, p: torch.Tensor, state: dict, group: dict) -> tuple:
        """(codes_m, absmax_m, codes_r, absmax_r) of this rank's shard of `p` as the step takes them."""
        num_blocks = math.ceil(local(p).numel() / group["block_size"])
        codes_m, absmax_m, codes_r, absmax_r = (local(state[k]) for k in _STATE_KEYS)
        return codes_m.view(-1), absmax_m[:num_blocks], codes_r.view(-1), absmax_r[:num_blocks]

    def _build_plan(self, key: tuple) -> _Plan:
        """Initialise missing states and sort the params with grads into kernel launches (one per
        param group, launch key and step count), batched fp32-state steps and the per-tensor rest."""
        by_key, small, loose = {}, {}, []
        for group_index, group in enumerate(self.param_groups):
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise DistillUserError("AdamW8bit does not support sparse gradients; use dense gradients")
                state = self.state[p] if self.state[p] else self._init_state(p, group)
                if "exp_avg" in state:
                    small.setdefault((group_index, p.device, state["step"]), []).append((p, state))
                elif ((use_triton := self._use_triton(p, group)) and local(p).is_contiguous()
                      and local(grad).is_contiguous()):
                    launch_key = adamw8bit_launch_key(local(p), local(grad), *self._kernel_state(p, state, group),
                                                      self.settings)
                    by_key.setdefault((group_index, state["step"], launch_key), []).append((p, state))
                else:
                    loose.append((p, state, group, use_triton))
        launches, fused_params = [], []
        for (group_index, _, (_, grad_dtype, aligned, _)), members in by_key.items():
            group = self.param_groups[group_index]
            states = [state for _, state in members]
            launch = AdamW8bitLaunch([local(p) for p, _ in members],
                                     [self._kernel_state(p, s, group) for p, s in members],
                                     block_size=group["block_size"], grad_dtype=grad_dtype, aligned=aligned,
                                     settings=self.settings)
            launches.append((group_index, launch, states))
            fused_params += [p for p, _ in members]
        small = [(gi, [m[0] for m in members], [m[1] for m in members]) for (gi, _, _), members in small.items()]
        return _Plan(key, launches, fused_params, small, loose, self.settings)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        key = (id(self.state), tuple(p.grad is not None for p in params), tuple(local(p).data_ptr() for p in params))
        plan = self.plans.current(self, key, self._build_plan)
        for state in plan.fused_states:
            state["step"] += 1
        for index, (group_index, launch, states) in enumerate(plan.launches):
            launch.run(plan.grads.for_launch(index), **_hyperparameters(self.param_groups[group_index],
                                                                         states[0]["step"]))
        for group_index, small_params, states in plan.small:
            for state in states:
                state["step"] += 1
            self._step_fp32(small_params, states, self.param_groups[group_index])
        for p, state, group, use_triton in plan.loose:
            state["step"] += 1
            adamw8bit_step([local(p)], [local(p.grad)], [self._kernel_state(p, state, group)],
                           block_size=group["block_size"], impl="triton" if use_triton else "torch",
                           settings=self.settings,
                           **_hyperparameters(group, state["step"]))
        return loss

    def _step_fp32(self, params: list[torch.Tensor], states: list[dict], group: dict) -> None:
        """torch.optim.AdamW's single-tensor arithmetic, op for op, batched over params that share a
        group, a device and a step count (foreach kernels on a GPU, the same ops per tensor on a CPU)."""
        beta1, beta2 = group["betas"]
        grads = [local(p.grad).float() for p in params]
        params = [local(p) for p in params]  # a sharded param's rows on this rank
        lowp = [i for i, p in enumerate(params) if p.dtype != torch.float32]
        param32 = [p.float() if p.dtype != torch.float32 else p for p in params]
        exp_avgs = [local(state["exp_avg"]) for state in states]
        exp_avg_sqs = [local(state["exp_avg_sq"]) for state in states]
        torch._foreach_mul_(param32, 1 - group["lr"] * group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        step_size, bias_correction2_sqrt = adamw_step_scalars(group["lr"], beta1, beta2, states[0]["step"])
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, bias_correction2_sqrt)
        torch._foreach_add_(denoms, group["eps"])
        torch._foreach_addcdiv_(param32, exp_avgs, denoms, value=-step_size)
        if lowp:
            torch._foreach_copy_([params[i] for i in lowp], [param32[i] for i in lowp])

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but every state tensor keeps its saved dtype.

        torch casts floating-point state to the parameter's dtype, which would turn uint8 codes
        into floats and round fp32 scales of bf16 parameters.
        """
        super().load_state_dict(state_dict)
        self.plans.forget()
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)
