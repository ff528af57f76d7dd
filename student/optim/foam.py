"""FOAM: Adam with both moments folded into block means along the last dimension.

Source: Wen et al., "FOAM: Blocked State Folding for Memory-Efficient LLM Training",
arXiv 2512.07112, and the authors' code (github.com/zqOuO/FOAM, ``foam_torch/foam_adam.py``).
Where paper and code differ, this follows the code. Per folded parameter p [..., n], gradient g,
level l, block b = 2**l, n' = ceil(n / b):

    A(x)  = mean of each b adjacent entries of the last dim, x zero-padded to n' * b   [..., n']
    E(y)  = y.repeat_interleave(b, -1)[..., :n]                                         [..., n]
    t    += 1
    g_bar = A(g);  s_bar = A(g * g)        # the code's block mean of g^2, not (block mean of g)^2
    R     = g - E(g_bar)                   # residual, recomputed every step, never stored
    m    <- beta1 * m + (1 - beta1) * g_bar                                  # state [..., n'] fp32
    v    <- beta2 * v + (1 - beta2) * s_bar                                  # state [..., n'] fp32
    M     = E(m) + rho * R;   V = E(v) + rho**2 * R**2
    u     = scale * M / (sqrt(V) + eps)
    p    <- p - lr * sqrt(1 - beta2**t) / (1 - beta1**t) * u
    p    <- p - lr * weight_decay * p      # decoupled, after the update, as the code does

Discrepancy: third-party write-ups of the paper update v with the square of the block mean,
A(g)**2; the released code uses A(g * g), so E(v) already holds the within-block variance and
R**2 comes on top. We follow the code (it produced the reported curves).

Parameters with ndim >= 2 in a group whose ``level`` is >= 1 are folded (leading dims flattened
as rows). Groups with level None or 0, and 1-D params in any group, take plain Adam in the same
bias-correction form (eps added to sqrt(v), bias corrections folded into the step size) with
scale 1. (Folding at level 0 is Adam, R = 0; the released code would still multiply a level-0
group by ``scale``, here ``scale`` reaches folded params only, as the project's API asks.)

Two paths behind one ``step``: ``foam_step_torch`` / ``adam_step_torch`` (reference, CPU path)
and a Triton kernel that reads p and g once per tile, updates the folded moments and writes p,
with no [rows, n] temporaries (plain Adam is the same kernel with b = 1). The optimizer launches it
once per group of tensors that share a param group, dtypes, block and step count (a few launches a
step), through address tables built once while the parameter set is unchanged; bias corrections
are host arithmetic on the Python step count, so a step syncs nothing with the host.
``foam_step_triton`` runs the kernel on one tensor.
Differences from the released code: moments are fp32 for any param dtype and bf16 params are
rounded once per step (the code rounds after the update and again after weight decay).
"""

from __future__ import annotations

import math
import os
import warnings
from numbers import Real

import torch
import torch.nn.functional as F

from distill.errors import DistillUserError

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path needs no Triton
    triton = None

__all__ = ["FOAM", "foam_param_groups", "foam_state_bytes_formula", "foam_step_torch", "adam_step_torch",
           "foam_step_triton", "MAX_LEVEL"]

MAX_LEVEL = 16  # block of 65,536 columns: far past any useful fold (the paper's largest is 8)
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements of p one Triton program handles: big enough to hide latency, small enough for registers.
_TILE_ELEMS = 4096
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


def _moment_shape(shape, block: int) -> tuple[int, ...]:
    shape = tuple(shape)
    return shape if block == 1 else shape[:-1] + (-(-shape[-1] // block),)


def foam_state_bytes_formula(shape, level: int | None) -> int:
    """Bytes of the two fp32 moments FOAM keeps for one param of ``shape`` folded at ``level``."""
    _check_level(level)
    shape = tuple(shape)
    return 2 * 4 * math.prod(_moment_shape(shape, 2**level if level and len(shape) >= 2 else 1))


# --- torch reference (also the CPU path) ---------------------------------------------------------

def _unfold(y: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """E: [..., n'] -> [..., n], each value repeated over its block, the padding cropped."""
    return y.repeat_interleave(block, dim=-1)[..., :n]


def _apply_update(p: torch.Tensor, update: torch.Tensor, step_size: float, decay: float) -> None:
    """p <- p - step_size * update, then p <- p - decay * p, in fp32, rounded to p's dtype once."""
    p32 = p if p.dtype == torch.float32 else p.float()
    p32.add_(update, alpha=-step_size)
    if decay > 0.0:
        p32.add_(p32, alpha=-decay)
    if p32 is not p:
        p.copy_(p32)


def foam_step_torch(p, grad, exp_avg, exp_avg_sq, *, block, beta1, beta2, eps, scale, rho, step_size, decay):
    """One folded step in place. p, grad [..., n] (any float dtype); exp_avg, exp_avg_sq
    [..., ceil(n / block)] fp32; step_size includes the bias corrections; decay = lr * weight_decay."""
    n = p.shape[-1]
    g = grad.float()
    pad = -n % block
    g_blocks = F.pad(g, (0, pad)).view(*g.shape[:-1], (n + pad) // block, block)  # [..., n', block], zero padded
    g_mean = g_blocks.mean(dim=-1)
    g2_mean = g_blocks.square().mean(dim=-1)
    exp_avg.mul_(beta1).add_(g_mean, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).add_(g2_mean, alpha=1.0 - beta2)
    resid = g - _unfold(g_mean, block, n)
    big_m = _unfold(exp_avg, block, n).add_(resid, alpha=rho)
    big_v = _unfold(exp_avg_sq, block, n).add_(resid.square(), alpha=rho * rho)
    update = scale * big_m / big_v.sqrt_().add_(eps)
    _apply_update(p, update, step_size, decay)


def adam_step_torch(p, grad, exp_avg, exp_avg_sq, *, beta1, beta2, eps, step_size, decay):
    """One plain Adam step in place, in FOAM's form: u = m / (sqrt(v) + eps). Moments fp32."""
    g = grad.float()
    exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    update = exp_avg / exp_avg_sq.sqrt().add_(eps)
    _apply_update(p, update, step_size, decay)


# --- Triton path: one launch per group of tensors --------------------------------------------------
#
# A launch covers every tensor of one param group that shares param dtype, grad dtype, fold block,
# alignment and step count. The tensors are addressed through tables on the device, built once per
# parameter set (``_FusedPlan``): ``meta`` [k, 8] int64 (param, exp_avg and exp_avg_sq addresses,
# n, ceil(n / block), rows * ceil(n / block), first tile, unused), ``tile_owner`` [num_tiles] int32
# (which tensor each program updates) and the grads' addresses [k] int64, uploaded again only when
# the grads move (a new backward with ``zero_grad(set_to_none=True)`` usually reuses the addresses).
# A program updates TILE_F consecutive folded entries of one tensor (flattened over the rows):
# a [TILE_F, BLOCK] tile of p.

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # for _as_pointer
_ALIGN_BYTES = 16  # vector loads need 16-byte aligned addresses; other tensors take an unhinted launch

if triton is not None:

    @triton.jit
    def _to_bf16_rtne(x):
        # fp32 -> bf16 rounded to nearest even, NaN kept, by bit arithmetic: the same on a GPU and in
        # Triton's interpreter, whose own cast truncates (a bf16 param would drift an ulp a step).
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x != x, 0x7FC0, bits)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _as_pointer(address, DTYPE: tl.constexpr):
        """An int64 address from a table as a pointer to DTYPE ("fp32", "bf16" or "fp16")."""
        if DTYPE == "bf16":
            ptr = address.to(tl.pointer_type(tl.bfloat16))
        elif DTYPE == "fp16":
            ptr = address.to(tl.pointer_type(tl.float16))
        else:
            ptr = address.to(tl.pointer_type(tl.float32))
        return ptr

    @triton.jit
    def _foam_tile(p_ptr, g_ptr, m_ptr, v_ptr, fold_start, n, n_folded, num_folded,
                   beta1, one_minus_beta1, beta2, one_minus_beta2, eps, scale, rho, rho_sq, step_size, decay,
                   BLOCK: tl.constexpr, TILE_F: tl.constexpr, EVEN: tl.constexpr, MASKED: tl.constexpr,
                   ROUND_BF16: tl.constexpr):
        f_local = tl.arange(0, TILE_F)
        j = tl.arange(0, BLOCK)
        m_ptrs = m_ptr + fold_start + f_local
        v_ptrs = v_ptr + fold_start + f_local
        if EVEN:  # n % BLOCK == 0: the tile is contiguous in p
            offs = fold_start * BLOCK + (f_local[:, None] * BLOCK + j[None, :])
        else:
            folds = fold_start + f_local
            rows = folds // n_folded
            cols = (folds - rows * n_folded)[:, None] * BLOCK + j[None, :]
            offs = rows[:, None] * n + cols
        if MASKED or not EVEN:
            fold_mask = (fold_start + f_local) < num_folded
            full_mask = fold_mask[:, None]
            if not EVEN:
                full_mask = full_mask & (cols < n)
            # Masked columns load as 0: the zero padding of the reference, which dilutes the last mean.
            g = tl.load(g_ptr + offs, mask=full_mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptrs, mask=fold_mask, other=0.0)
            v = tl.load(v_ptrs, mask=fold_mask, other=0.0)
            p = tl.load(p_ptr + offs, mask=full_mask, other=0.0).to(tl.float32)
        else:
            g = tl.load(g_ptr + offs).to(tl.float32)
            m = tl.load(m_ptrs)
            v = tl.load(v_ptrs)
            p = tl.load(p_ptr + offs).to(tl.float32)

        g_mean = tl.sum(g, axis=1) / BLOCK
        g2_mean = tl.sum(g * g, axis=1) / BLOCK
        m = m * beta1 + one_minus_beta1 * g_mean
        v = v * beta2 + one_minus_beta2 * g2_mean
        resid = g - g_mean[:, None]
        big_m = m[:, None] + rho * resid
        big_v = v[:, None] + rho_sq * (resid * resid)
        # IEEE sqrt and division: the GPU defaults are approximate, the reference is not.
        update = tl.div_rn(scale * big_m, tl.sqrt_rn(big_v) + eps)
        p = p - step_size * update
        p = p - decay * p
        if ROUND_BF16:
            p_out = _to_bf16_rtne(p)
        else:
            p_out = p.to(p_ptr.dtype.element_ty)
        if MASKED or not EVEN:
            tl.store(m_ptrs, m, mask=fold_mask)
            tl.store(v_ptrs, v, mask=fold_mask)
            tl.store(p_ptr + offs, p_out, mask=full_mask)
        else:
            tl.store(m_ptrs, m)
            tl.store(v_ptrs, v)
            tl.store(p_ptr + offs, p_out)

    @triton.jit
    def _foam_multi_kernel(meta_ptr, grad_addr_ptr, tile_owner_ptr,
                           beta1, one_minus_beta1, beta2, one_minus_beta2, eps, scale, rho, rho_sq, step_size, decay,
                           P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BLOCK: tl.constexpr, TILE_F: tl.constexpr,
                           EVEN: tl.constexpr, ALIGNED: tl.constexpr, ROUND_BF16: tl.constexpr):
        pid = tl.program_id(0)
        owner = tl.load(tile_owner_ptr + pid).to(tl.int64)
        row = meta_ptr + owner * 8
        p_ptr = _as_pointer(tl.load(row), P_DTYPE)
        m_ptr = _as_pointer(tl.load(row + 1), "fp32")
        v_ptr = _as_pointer(tl.load(row + 2), "fp32")
        g_ptr = _as_pointer(tl.load(grad_addr_ptr + owner), G_DTYPE)
        if ALIGNED:
            p_ptr = tl.multiple_of(p_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
        n = tl.load(row + 3)
        n_folded = tl.load(row + 4)
        num_folded = tl.load(row + 5)
        fold_start = (pid - tl.load(row + 6)) * TILE_F
        # Only a tensor's last tile needs masks (when n % BLOCK == 0): the others load whole vectors.
        if fold_start + TILE_F <= num_folded:
            _foam_tile(p_ptr, g_ptr, m_ptr, v_ptr, fold_start, n, n_folded, num_folded,
                       beta1, one_minus_beta1, beta2, one_minus_beta2, eps, scale, rho, rho_sq, step_size, decay,
                       BLOCK, TILE_F, EVEN, False, ROUND_BF16)
        else:
            _foam_tile(p_ptr, g_ptr, m_ptr, v_ptr, fold_start, n, n_folded, num_folded,
                       beta1, one_minus_beta1, beta2, one_minus_beta2, eps, scale, rho, rho_sq, step_size, decay,
                       BLOCK, TILE_F, EVEN, True, ROUND_BF16)



def _tile_folds(block: int) -> int:
    """Folded entries per program: TILE_F * block ~ _TILE_ELEMS (a power of two, at least 1)."""
    return max(1, _TILE_ELEMS // block)


def _upload(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without a host sync (pinned staging on CUDA)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % _ALIGN_BYTES == 0 for t in tensors)


class _Launch:
    """One kernel launch: params (contiguous, 2-D view [rows, n]) that share a param group, dtypes,
    fold block, alignment and step count, with their device tables."""

    def __init__(self, group_index, block, even, aligned, p_dtype, g_dtype, params, states):
        self.group_index, self.block, self.even, self.aligned = group_index, block, even, aligned
        self.p_dtype, self.g_dtype = p_dtype, g_dtype
        self.params, self.states = params, states
        self.tile_f = _tile_folds(block)
        meta, owners, first_tile = [], [], 0
        for i, (p, state) in enumerate(zip(params, states)):
            n = p.shape[-1] if p.ndim else 1
            n_folded = -(-n // block)
            num_folded = (p.numel() // n) * n_folded
            num_tiles = -(-num_folded // self.tile_f)
            meta += [p.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(), n, n_folded,
                     num_folded, first_tile, 0]
            owners += [i] * num_tiles
            first_tile += num_tiles
        self.num_tiles = first_tile
        device = params[0].device
        self.meta = _upload(meta, torch.int64, device)
        self.tile_owner = _upload(owners, torch.int32, device)

    def run(self, grad_addrs: torch.Tensor, *, beta1, beta2, eps, scale, rho, step_size, decay) -> None:
        """grad_addrs: int64 [len(params)] on the device, the grads' addresses in param order."""
        _foam_multi_kernel[(self.num_tiles,)](
            self.meta, grad_addrs, self.tile_owner,
            beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, scale, rho, rho * rho, step_size, decay,
            P_DTYPE=_DTYPE_NAMES[self.p_dtype], G_DTYPE=_DTYPE_NAMES[self.g_dtype], BLOCK=self.block,
            TILE_F=self.tile_f, EVEN=self.even, ALIGNED=self.aligned,
            ROUND_BF16=self.p_dtype == torch.bfloat16, num_warps=4 if self.tile_f * self.block <= 2048 else 8,
        )


def _launch_key(group_index, p, grad, state, block):
    n = p.shape[-1] if p.ndim else 1
    aligned = _aligned(p, grad, state["exp_avg"], state["exp_avg_sq"])
    return (group_index, p.dtype, grad.dtype, block, n % block == 0, aligned, state["step"], p.device)


def foam_step_triton(p, grad, exp_avg, exp_avg_sq, *, block, beta1, beta2, eps, scale, rho, step_size, decay):
    """Same contract as ``foam_step_torch``, one tensor through the multi-tensor kernel (the
    optimizer batches its params instead); block = 1 with scale = 1 is plain Adam."""
    if p.numel() == 0:
        return
    assert exp_avg.is_contiguous() and exp_avg_sq.is_contiguous() and exp_avg.shape == _moment_shape(p.shape, block)
    work = p if p.is_contiguous() else p.contiguous()
    grad = grad.contiguous()
    state = dict(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=0)
    _, p_dtype, g_dtype, _, even, aligned, _, _ = _launch_key(0, work, grad, state, block)
    launch = _Launch(0, block, even, aligned, p_dtype, g_dtype, [work], [state])
    launch.run(_upload([grad.data_ptr()], torch.int64, p.device), beta1=beta1, beta2=beta2, eps=eps, scale=scale,
               rho=rho, step_size=step_size, decay=decay)
    if work is not p:
        p.copy_(work)


def _step_scalars(group: dict, block: int, t: int) -> dict:
    """The kernel's scalars for step t of a group; bias corrections folded into the step size."""
    beta1, beta2 = group["betas"]
    return dict(beta1=beta1, beta2=beta2, eps=group["eps"], scale=group["scale"] if block > 1 else 1.0,
                rho=group["rho"], step_size=group["lr"] * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t),
                decay=group["lr"] * group["weight_decay"])


class _FusedPlan:
    """What one ``FOAM.step`` does, for a fixed set of params with grads: the batched launches and
    the params left to the per-tensor paths. Built by ``FOAM._build_plan``, reused while ``key``
    (the state dict, the groups' levels, which params have grads, the params' addresses) holds."""

    def __init__(self, key, launches, loose):
        self.key = key
        self.launches = launches  # list[_Launch]
        self.loose = loose  # [(param, group, use_triton)] for the per-tensor paths
        self.fused_params = [p for launch in launches for p in launch.params]
        self.fused_states = [s for launch in launches for s in launch.states]
        self.planned = [(launch.g_dtype, launch.aligned) for launch in launches for _ in launch.params]
        self.grad_addrs = None  # the grads' addresses last uploaded, and their dtypes
        self.grad_dtypes = None
        self.grad_table = None  # int64 [len(fused_params)] on the device
        self.offsets = []
        start = 0
        for launch in launches:
            self.offsets.append(start)
            start += len(launch.params)

    def grads_fit(self, grads: list[torch.Tensor], addrs: list[int]) -> bool:
        """Whether these grads can take the planned launches (dtype, layout and alignment)."""
        return all(g.dtype == dtype and g.is_contiguous() and (not aligned or addr % _ALIGN_BYTES == 0)
                   for g, addr, (dtype, aligned) in zip(grads, addrs, self.planned))


# --- the optimizer -----------------------------------------------------------------------------------

class FOAM(torch.optim.Optimizer):
    """Folded Adam (see the module docstring for the update).

    params: tensors or param groups; each group may set its own ``level`` (None or 0: plain Adam),
    ``scale`` (folded params only), ``rho``, ``lr``, ``betas``, ``eps``, ``weight_decay``.
    fused: None picks the Triton kernel for fp32/bf16/fp16 CUDA params when Triton is installed,
    the torch path otherwise; True always uses the kernel (on a CPU only under TRITON_INTERPRET=1,
    for tests); False never.
    State per param: ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` (fp32, [..., ceil(n / 2**level)]
    for folded params, the param's shape otherwise).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, level=2,
                 scale=0.25, rho=1.0, fused=None):
        if fused not in (None, True, False):
            raise DistillUserError(f"`fused` must be None, True or False, got {fused!r}")
        if fused and triton is None:
            raise DistillUserError("`fused=True` needs the triton package (pip install triton); or pass fused=None")
        self.fused = fused
        self._warned_no_triton = False
        self._plan = None  # the batched launches of the last step (see _FusedPlan)
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
            if not p.is_cuda or p.dtype not in _TRITON_DTYPES:
                return False
            if triton is None:
                if not self._warned_no_triton:
                    warnings.warn("FOAM: triton is not installed, CUDA params use the slower torch path")
                    self._warned_no_triton = True
                return False
            return True
        if p.dtype not in _TRITON_DTYPES:
            raise DistillUserError(f"`fused=True` takes fp32, bf16 or fp16 params, got {p.dtype}; pass fused=None")
        if not p.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise DistillUserError(
                f"`fused=True` needs CUDA params (or TRITON_INTERPRET=1 set before import), got {p.device}; "
                "pass fused=None"
            )
        return True

    def _init_state(self, p: torch.Tensor, block: int, level) -> dict:
        state = self.state[p]
        shape = _moment_shape(p.shape, block)
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        elif tuple(state["exp_avg"].shape) != shape:
            raise DistillUserError(
                f"FOAM state of a param of shape {tuple(p.shape)} has moments of shape "
                f"{tuple(state['exp_avg'].shape)}, but level {level} needs {shape}; a group's level cannot "
                "change once it has stepped"
            )
        return state

    def _plan_key(self, params: list[torch.Tensor], grads: list) -> tuple:
        return (id(self.state), tuple(group["level"] for group in self.param_groups),
                tuple(g is not None for g in grads), tuple(p.data_ptr() for p in params))

    def _build_plan(self, key: tuple) -> _FusedPlan:
        """Initialise missing states, check the levels, sort the params with grads into launches."""
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
                if use_triton and p.numel() > 0 and p.is_contiguous() and grad.is_contiguous():
                    by_key.setdefault(_launch_key(group_index, p, grad, state, block), []).append((p, state))
                else:
                    loose.append((p, group, use_triton))
        launches = []
        for (group_index, p_dtype, g_dtype, block, even, aligned, _, _), members in by_key.items():
            params, states = [m[0] for m in members], [m[1] for m in members]
            launches.append(_Launch(group_index, block, even, aligned, p_dtype, g_dtype, params, states))
        return _FusedPlan(key, launches, loose)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        key = self._plan_key(params, [p.grad for p in params])
        plan = self._plan
        if plan is None or plan.key != key:
            plan = self._plan = self._build_plan(key)
        if plan.launches:
            grads = [p.grad for p in plan.fused_params]
            addrs = [g.data_ptr() for g in grads]
            if addrs != plan.grad_addrs or [g.dtype for g in grads] != plan.grad_dtypes:
                if not plan.grads_fit(grads, addrs):  # a grad changed dtype or layout: sort again
                    plan = self._plan = self._build_plan(key)
                    grads = [p.grad for p in plan.fused_params]
                    addrs = [g.data_ptr() for g in grads]
                plan.grad_addrs = addrs
                plan.grad_dtypes = [g.dtype for g in grads]
                plan.grad_table = _upload(addrs, torch.int64, plan.fused_params[0].device)
            for state in plan.fused_states:
                state["step"] += 1
            for launch, offset in zip(plan.launches, plan.offsets):
                group = self.param_groups[launch.group_index]
                launch.run(plan.grad_table[offset:offset + len(launch.params)],
                           **_step_scalars(group, launch.block, launch.states[0]["step"]))
        for p, group, use_triton in plan.loose:
            self._step_one(p, group, use_triton)
        return loss

    def _step_one(self, p: torch.Tensor, group: dict, use_triton: bool) -> None:
        """The per-tensor paths: the torch reference, or the kernel on a copy of a strided param."""
        block = _block_size(group["level"], p)
        state = self.state[p]
        state["step"] += 1
        args = _step_scalars(group, block, state["step"])
        if use_triton:
            foam_step_triton(p, p.grad, state["exp_avg"], state["exp_avg_sq"], block=block, **args)
        elif block > 1:
            foam_step_torch(p, p.grad, state["exp_avg"], state["exp_avg_sq"], block=block, **args)
        else:
            del args["scale"], args["rho"]
            adam_step_torch(p, p.grad, state["exp_avg"], state["exp_avg_sq"], **args)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every float state tensor to its param's dtype; FOAM's moments stay
        fp32, so they are taken again from ``state_dict`` after the torch load."""
        super().load_state_dict(state_dict)
        self._plan = None
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
