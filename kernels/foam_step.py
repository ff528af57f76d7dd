"""FOAM's optimizer step: Adam with both moments folded into block means along the last dimension.

Per param p [..., n], gradient g, block b (a power of two; the optimizer's level is log2 b), step
count t (1 at the first step), n' = ceil(n / b):

    A(x)  = mean of each b adjacent entries of the last dim, x zero-padded to n' * b   [..., n']
    E(y)  = y.repeat_interleave(b, -1)[..., :n]                                         [..., n]
    g_bar = A(g);  s_bar = A(g * g)        # the block mean of g^2, not (block mean of g)^2
    R     = g - E(g_bar)                   # residual, recomputed every step, never stored
    m    <- beta1 * m + (1 - beta1) * g_bar                                  # state [..., n'] fp32
    v    <- beta2 * v + (1 - beta2) * s_bar                                  # state [..., n'] fp32
    M     = E(m) + rho * R;   V = E(v) + rho**2 * R**2
    p    <- p - lr * sqrt(1 - beta2**t) / (1 - beta1**t) * scale * M / (sqrt(V) + eps)
    p    <- p - lr * weight_decay * p      # decoupled, after the update

At b = 1 this is Adam (R = 0) in the same bias-correction form (eps added to sqrt(v), the
corrections folded into the step size). student/optim/foam.py holds the optimizer, its sources
and where it departs from them.

Layout, as every kernel here: ``foam_step_torch`` is the reference for one tensor (and the path
of CUDA tensors without Triton); ``foam_step_cpu`` the CPU path, the reference on cache-sized slices
of rows, equal to it bit for bit; ``_foam_kernel`` the Triton step, which reads p and g once per
tile, updates the folded moments and writes p, with no [rows, n] temporaries; ``FoamLaunch`` the launcher of one
multi-tensor launch (kernels/multi_tensor.py), which the optimizer keeps from step to step;
``foam_step`` the public function over lists of tensors, validating its inputs, with
impl="auto" | "triton" | "torch". Bias corrections are host arithmetic on the step count, so a
step syncs nothing with the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.multi_tensor import (TRITON_DTYPE_NAMES, TensorTable, check_number, check_step, is_aligned,
                                  is_power_of_two, runs_triton, upload)

try:
    import triton
    import triton.language as tl

    from kernels.multi_tensor import as_pointer, locate_tile, to_bf16_rtne
except ImportError:  # the torch path needs no Triton
    triton = None

__all__ = ["FoamLaunch", "FoamStepSettings", "foam_launch_key", "foam_moment_shape", "foam_step", "foam_step_cpu",
           "foam_step_torch"]


@dataclass(frozen=True)
class FoamStepSettings:
    """How the Triton step cuts its work; the defaults are the production path (the step's
    benchmark rows `optimizer_step/qwen2-0.5b/foam-*` in tests/benchmarks/RESULTS.md, "Optimizers", were measured
    with them)."""

    tile_elems: int = 4096  # elements of p one program updates (whole blocks); a power of two:
    # large enough to hide memory latency, small enough for a tile of fp32 values to stay in registers
    align_bytes: int = 16  # tensors at multiples of this many bytes take vector-load hints, others an unhinted launch

    def __post_init__(self):
        for name in ("tile_elems", "align_bytes"):
            if not is_power_of_two(getattr(self, name)):
                raise ValueError(f"FoamStepSettings.{name} must be a power of two >= 1, got {getattr(self, name)!r}")

    def folds_per_tile(self, block: int) -> int:
        """Folded entries a program updates: TILE_F * block = tile_elems, at least one block."""
        return max(1, self.tile_elems // block)


def foam_moment_shape(shape, block: int) -> tuple[int, ...]:
    """The moments' shape for a param of ``shape`` at ``block``: [..., ceil(n / block)]."""
    shape = tuple(shape)
    return shape if block == 1 or not shape else shape[:-1] + (-(-shape[-1] // block),)


def _host_scalars(lr, beta1, beta2, weight_decay, step) -> tuple[float, float]:
    """(step size with both bias corrections, decay factor lr * weight_decay) of step ``step``."""
    return lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step), lr * weight_decay


# --- torch reference (also the CPU path) ---------------------------------------------------------

def _unfold(y: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """E: [..., n'] -> [..., n], each value repeated over its block, the padding cropped."""
    return y.repeat_interleave(block, dim=-1)[..., :n]


def foam_step_torch(p, grad, exp_avg, exp_avg_sq, *, block, lr, beta1, beta2, eps, weight_decay, scale, rho,
                    step) -> None:
    """One FOAM step of one tensor in place (inputs as ``foam_step`` checks them). p, grad [..., n]
    (any float dtype); exp_avg, exp_avg_sq fp32 [..., ceil(n / block)]; step: this step's count
    (1 at the first). The new p is computed in fp32 and rounded to p's dtype once."""
    step_size, decay = _host_scalars(lr, beta1, beta2, weight_decay, step)
    g = grad.float()
    if block == 1:  # Adam: the folded form below with R = 0, without its padding and repeats
        exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        update = exp_avg.mul(scale).div_(exp_avg_sq.sqrt().add_(eps))
    else:
        n = p.shape[-1]
        pad = -n % block
        g_blocks = F.pad(g, (0, pad)).view(*g.shape[:-1], (n + pad) // block, block)  # [..., n', block]
        g_mean = g_blocks.mean(dim=-1)
        g2_mean = g_blocks.square().mean(dim=-1)
        exp_avg.mul_(beta1).add_(g_mean, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).add_(g2_mean, alpha=1.0 - beta2)
        resid = g - _unfold(g_mean, block, n)
        big_m = _unfold(exp_avg, block, n).add_(resid, alpha=rho)
        big_v = _unfold(exp_avg_sq, block, n).add_(resid.square(), alpha=rho * rho)
        update = big_m.mul_(scale).div_(big_v.sqrt_().add_(eps))
    p32 = p if p.dtype == torch.float32 else p.float()
    p32.add_(update, alpha=-step_size)
    if decay > 0.0:
        p32.add_(p32, alpha=-decay)
    if p32 is not p:
        p.copy_(p32)


# --- CPU step -------------------------------------------------------------------------------------

# The CPU step's piece: on a 2-core CPU, rows of about 2^20 elements ran a 18,944 x 3,584 matrix's step
# fastest of 2^16..2^22 elements.
CPU_CHUNK_ELEMENTS = 1 << 20


def foam_step_cpu(p, grad, exp_avg, exp_avg_sq, *, block, lr, beta1, beta2, eps, weight_decay, scale, rho, step,
                  chunk_elements: int = CPU_CHUNK_ELEMENTS) -> None:
    """``foam_step_torch``'s step, bit for bit, for CPU tensors: the reference on slices of whole rows
    of about `chunk_elements` elements (a row's folds depend on that row alone), so each slice's
    temporaries stay in the CPU's caches and come from the allocator's free lists instead of fresh
    pages (the reference's [rows, n] temporaries of a large matrix cost a page fault every 4 KiB),
    where the process's heap keeps freed pieces (student.host_heap; the trainer's process does). Its
    many short parallel regions want the main thread's OpenMP team spinning, the process's only one
    (student.host_threads)."""
    n = p.shape[-1] if p.dim() else 1
    rows = p.numel() // n if n else 0
    per = max(1, chunk_elements // max(n, 1))
    if p.dim() < 2 or rows <= per:
        foam_step_torch(p, grad, exp_avg, exp_avg_sq, block=block, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, scale=scale, rho=rho, step=step)
        return
    work = p.detach().reshape(rows, n)  # p itself when contiguous
    g = grad.reshape(rows, n)
    m, v = exp_avg.view(rows, -1), exp_avg_sq.view(rows, -1)
    for r in range(0, rows, per):
        foam_step_torch(work[r:r + per], g[r:r + per], m[r:r + per], v[r:r + per], block=block, lr=lr, beta1=beta1,
                        beta2=beta2, eps=eps, weight_decay=weight_decay, scale=scale, rho=rho, step=step)
    if work.data_ptr() != p.data_ptr():  # p was not contiguous: reshape copied it
        p.copy_(work.view_as(p))


# --- Triton step ----------------------------------------------------------------------------------
#
# A launch covers tensors that share param dtype, grad dtype, block, alignment and whether
# n % block == 0 ("even"), and one set of hyperparameters. Meta columns per tensor: the addresses of
# p, exp_avg and exp_avg_sq, n, ceil(n / block), rows * ceil(n / block). A program updates TILE_F
# consecutive folded entries of one tensor (flattened over the rows): a [TILE_F, BLOCK] tile of p.

if triton is not None:

    @triton.jit
    def _foam_tile(p_ptr, g_ptr, m_ptr, v_ptr, fold_start, n, n_folded, num_folded,
                   beta1, one_minus_beta1, beta2, one_minus_beta2, eps, scale, rho, rho_sq, step_size, decay,
                   BLOCK: tl.constexpr, TILE_F: tl.constexpr, EVEN: tl.constexpr, MASKED: tl.constexpr,
                   ROUND_BF16: tl.constexpr):
        f_local = tl.arange(0, TILE_F)
        j = tl.arange(0, BLOCK)
        m_ptrs = m_ptr + fold_start + f_local
        v_ptrs = v_ptr + fold_start + f_local
        if EVEN:  # the tile is contiguous in p
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
            p_out = to_bf16_rtne(p)
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
    def _foam_kernel(meta_ptr, grad_addr_ptr, tile_owner_ptr,
                     beta1, one_minus_beta1, beta2, one_minus_beta2, eps, scale, rho, rho_sq, step_size, decay,
                     P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BLOCK: tl.constexpr, TILE_F: tl.constexpr,
                     EVEN: tl.constexpr, ALIGN: tl.constexpr, ROUND_BF16: tl.constexpr):
        owner, row, tile = locate_tile(meta_ptr, tile_owner_ptr)
        p_ptr = as_pointer(tl.load(row), P_DTYPE)
        m_ptr = as_pointer(tl.load(row + 1), "fp32")
        v_ptr = as_pointer(tl.load(row + 2), "fp32")
        g_ptr = as_pointer(tl.load(grad_addr_ptr + owner), G_DTYPE)
        if ALIGN > 1:  # here, not in a helper: a hint returned from a called function is lost
            p_ptr = tl.multiple_of(p_ptr, ALIGN)
            m_ptr = tl.multiple_of(m_ptr, ALIGN)
            v_ptr = tl.multiple_of(v_ptr, ALIGN)
            g_ptr = tl.multiple_of(g_ptr, ALIGN)
        n = tl.load(row + 3)
        n_folded = tl.load(row + 4)
        num_folded = tl.load(row + 5)
        fold_start = tile * TILE_F
        # Only a tensor's last tile needs masks (when n % BLOCK == 0): the others load whole vectors.
        if fold_start + TILE_F <= num_folded:
            _foam_tile(p_ptr, g_ptr, m_ptr, v_ptr, fold_start, n, n_folded, num_folded,
                       beta1, one_minus_beta1, beta2, one_minus_beta2, eps, scale, rho, rho_sq, step_size, decay,
                       BLOCK, TILE_F, EVEN, False, ROUND_BF16)
        else:
            _foam_tile(p_ptr, g_ptr, m_ptr, v_ptr, fold_start, n, n_folded, num_folded,
                       beta1, one_minus_beta1, beta2, one_minus_beta2, eps, scale, rho, rho_sq, step_size, decay,
                       BLOCK, TILE_F, EVEN, True, ROUND_BF16)


def foam_launch_key(p, grad, exp_avg, exp_avg_sq, block: int, settings: FoamStepSettings) -> tuple:
    """What tensors must share to go in one launch: (p dtype, grad dtype, block, even, aligned, device)."""
    n = p.shape[-1] if p.ndim else 1
    aligned = is_aligned((p, grad, exp_avg, exp_avg_sq), settings.align_bytes)
    return (p.dtype, grad.dtype, block, n % block == 0, aligned, p.device)


class FoamLaunch:
    """One launch of the Triton step over contiguous tensors with one ``foam_launch_key``; its tables
    are built here, once, and stay valid while the tensors (not their grads) stay where they are."""

    def __init__(self, params, exp_avgs, exp_avg_sqs, *, block: int, grad_dtype: torch.dtype, aligned: bool,
                 settings: FoamStepSettings):
        self.params, self.block, self.grad_dtype, self.aligned = params, block, grad_dtype, aligned
        self.p_dtype = params[0].dtype
        self.even = all((p.shape[-1] if p.ndim else 1) % block == 0 for p in params)
        self.tile_f = settings.folds_per_tile(block)
        self.align = settings.align_bytes if aligned else 1
        columns, tiles = [], []
        for p, exp_avg, exp_avg_sq in zip(params, exp_avgs, exp_avg_sqs):
            n = p.shape[-1] if p.ndim else 1
            n_folded = -(-n // block)
            num_folded = (p.numel() // n) * n_folded if n else 0
            columns.append([p.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n, n_folded, num_folded])
            tiles.append(-(-num_folded // self.tile_f))
        self.table = TensorTable(columns, tiles, params[0].device)
        self.num_tensors = self.table.num_tensors

    def run(self, grad_addresses: torch.Tensor, *, lr, beta1, beta2, eps, weight_decay, scale, rho, step) -> None:
        """grad_addresses: int64 [num_tensors] on the device, the grads' addresses in param order."""
        if self.table.num_tiles == 0:
            return
        step_size, decay = _host_scalars(lr, beta1, beta2, weight_decay, step)
        _foam_kernel[(self.table.num_tiles,)](
            self.table.meta, grad_addresses, self.table.tile_owner,
            beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, scale, rho, rho * rho, step_size, decay,
            P_DTYPE=TRITON_DTYPE_NAMES[self.p_dtype], G_DTYPE=TRITON_DTYPE_NAMES[self.grad_dtype], BLOCK=self.block,
            TILE_F=self.tile_f, EVEN=self.even, ALIGN=self.align, ROUND_BF16=self.p_dtype == torch.bfloat16,
            num_warps=4 if self.tile_f * self.block <= 2048 else 8,
        )


# --- public function ------------------------------------------------------------------------------

def _validate(params, grads, exp_avgs, exp_avg_sqs, block, scalars, impl, settings) -> bool:
    """Raise ValueError on a bad input; return whether the Triton step runs."""
    if not isinstance(settings, FoamStepSettings):
        raise ValueError(f"`settings` must be a FoamStepSettings, got {type(settings).__name__}")
    if not is_power_of_two(block):
        raise ValueError(f"`block` must be a power of two >= 1 (2**level), got {block!r}")
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs):
        raise ValueError(f"params, grads, exp_avgs and exp_avg_sqs must be lists of one length, got "
                         f"{len(params)}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}")
    for name in ("lr", "eps", "weight_decay", "rho"):
        check_number(name, scalars[name], 0.0)
    check_number("beta1", scalars["beta1"], 0.0, 1.0)
    check_number("beta2", scalars["beta2"], 0.0, 1.0)
    check_number("scale", scalars["scale"], 0.0, low_inclusive=False)
    check_step(scalars["step"])
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if not p.dtype.is_floating_point or not g.dtype.is_floating_point or g.shape != p.shape:
            raise ValueError(f"params[{i}] and grads[{i}] must be float tensors of one shape, got {p.dtype} "
                             f"{tuple(p.shape)} and {g.dtype} {tuple(g.shape)}")
        want = foam_moment_shape(p.shape, block)
        for name, s in (("exp_avgs", m), ("exp_avg_sqs", v)):
            if s.dtype != torch.float32 or tuple(s.shape) != want or not s.is_contiguous():
                raise ValueError(f"{name}[{i}] must be a contiguous fp32 tensor of shape {want} (block {block}), "
                                 f"got {s.dtype} {tuple(s.shape)}")
        if len({p.device, g.device, m.device, v.device}) != 1:
            raise ValueError(f"params[{i}], its grad and moments must be on one device, got {p.device}, {g.device}, "
                             f"{m.device}, {v.device}")
    return runs_triton(impl, (*params, *grads))


def foam_step(params, grads, exp_avgs, exp_avg_sqs, *, block: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, scale: float, rho: float, step: int, impl: str = "auto",
              settings: FoamStepSettings | None = None) -> None:
    """One FOAM step in place over lists of tensors that share the hyperparameters and step count.

    params[i], grads[i]: [..., n] of one shape (fp32, bf16 or fp16 for the kernel; any float dtype for
    the torch path; any layout); exp_avgs[i], exp_avg_sqs[i]: fp32 contiguous [..., ceil(n / block)],
    updated in place. block: 2**level (1: Adam). step: this step's count, 1 at the first.
    impl: "auto" (the Triton step for CUDA tensors when Triton is installed, else torch) | "triton"
    (also on the CPU under TRITON_INTERPRET=1, for tests) | "torch". settings: the kernel's tiling
    (default ``FoamStepSettings()``). Strided params and grads take the kernel on contiguous copies.
    The torch path of CPU tensors is ``foam_step_cpu``.
    """
    settings = FoamStepSettings() if settings is None else settings
    scalars = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, scale=scale, rho=rho,
                   step=step)
    if not _validate(params, grads, exp_avgs, exp_avg_sqs, block, scalars, impl, settings):
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            (foam_step_cpu if p.device.type == "cpu" else foam_step_torch)(p, g, m, v, block=block, **scalars)
        return
    groups: dict[tuple, list] = {}
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        if p.numel() == 0:
            continue
        work, g = p.contiguous(), g.contiguous()
        groups.setdefault(foam_launch_key(work, g, m, v, block, settings), []).append((p, work, g, m, v))
    for (_, grad_dtype, _, _, aligned, device), members in groups.items():
        launch = FoamLaunch([w for _, w, _, _, _ in members], [m for *_, m, _ in members],
                            [v for *_, v in members], block=block, grad_dtype=grad_dtype, aligned=aligned,
                            settings=settings)
        launch.run(upload([g.data_ptr() for _, _, g, _, _ in members], torch.int64, device), **scalars)
        for p, work, *_ in members:
            if work is not p:
                p.copy_(work)
