"""The 8-bit AdamW step: AdamW whose two moments live block-wise in 8 bits.

Each parameter's moments are flattened and cut into blocks of ``block_size`` elements; a block
keeps one fp32 absmax scale and one uint8 code per element. A step dequantises, updates in fp32
exactly as torch.optim.AdamW does, applies the update with the fp32 moments, then requantises
(round to nearest). The first moment m is stored signed; the second as r = sqrt(v), unsigned
(student/optim/adam8bit.py says why, and tests/test_adam8bit.py measures it).

The codes (``dynamic_code``): a "dynamic tree" code, as in Dettmers et al. (8-bit optimizers via
block-wise quantization). Leading zero bits pick a decade 10^-E, the bits after an indicator bit
pick one of 2^F linear steps in (0.1, 1] of that decade. So the precision sits near the block
maximum (which the code holds exactly: 1.0 is a code value) and small values keep their order of
magnitude down to 1e-6 (signed) / 1e-7 (unsigned) of the block maximum instead of rounding to zero
as a linear code would. Precision falls with the decade: in (0.1, 1] the worst rounding error is
0.9 / 2^(F+1) of the block maximum, F = 6 signed (a sign bit, 255 values) and 7 unsigned (256).

Layout, as every kernel here: ``quantize_blockwise`` / ``dequantize_blockwise`` and
``adamw8bit_step_torch`` are the reference for one tensor (and the path of CUDA tensors without
Triton); ``adamw8bit_step_cpu`` the CPU path, the reference on cache-sized pieces, equal to it
bit for bit; ``_adam8bit_kernel`` the Triton step, which dequantises, updates and requantises
each block in one pass;
``AdamW8bitLaunch`` the launcher of one multi-tensor launch (kernels/multi_tensor.py), kept by the
optimizer from step to step; ``adamw8bit_step`` the public function over lists of tensors,
validating its inputs, with impl="auto" | "triton" | "torch".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.multi_tensor import (TRITON_DTYPE_NAMES, TensorTable, check_number, check_step, is_aligned,
                                  is_power_of_two, runs_triton, upload)

try:
    import triton
    import triton.language as tl

    from kernels.multi_tensor import as_pointer, locate_tile, to_bf16_rtne
except ImportError:  # the torch path needs no Triton
    triton = None

__all__ = ["AdamW8bitLaunch", "AdamW8bitStepSettings", "adamw8bit_launch_key", "adamw8bit_step", "adamw8bit_step_cpu",
           "adamw8bit_step_torch", "adamw_step_scalars", "dequantize_blockwise", "dynamic_code", "nearest_code",
           "quantize_blockwise"]


def _nextis_power_of_two(value: int) -> int:
    return 1 << (value - 1).bit_length()


@dataclass(frozen=True)
class AdamW8bitStepSettings:
    """How the Triton step cuts its work; the defaults are the production path (the step's
    benchmark rows `optimizer_step/qwen2-0.5b/adamw8bit-*` in tests/benchmarks/RESULTS.md, "Optimizers", were measured
    with them)."""

    tile_elems: int = 2048  # elements one program updates (whole blocks, padded to a power of two)
    max_block: int = 8192  # the largest padded block_size the kernel takes: one block must fit in one
    # program's registers; the optimizer sends larger blocks to the torch path
    align_bytes: int = 16  # tensors at multiples of this many bytes take vector-load hints, others an unhinted launch
    num_warps: int = 8

    def __post_init__(self):
        for name in ("tile_elems", "max_block", "align_bytes", "num_warps"):
            if not is_power_of_two(getattr(self, name)):
                raise ValueError(f"AdamW8bitStepSettings.{name} must be a power of two >= 1, "
                                 f"got {getattr(self, name)!r}")

    def takes_block(self, block_size: int) -> bool:
        """Whether the kernel takes blocks of ``block_size`` (padded to a power of two)."""
        return _nextis_power_of_two(block_size) <= self.max_block


def adamw_step_scalars(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """(lr / (1 - beta1**step), sqrt(1 - beta2**step)): torch AdamW's step size and the square root of
    its second bias correction, host arithmetic on the step count."""
    return lr / (1 - beta1**step), math.sqrt(1 - beta2**step)


# --- torch reference (also the CPU path) ---------------------------------------------------------

def dynamic_code(signed: bool) -> torch.Tensor:
    """Sorted fp32 code values in [-1, 1] (signed: 255 values) or [0, 1] (unsigned: 256 values).

    A magnitude of B bits (7 signed, 8 unsigned): all-zero bits is 0; otherwise E leading zeros,
    an indicator 1, and F = B - 1 - E fraction bits give 10^-E * (0.1 + 0.9 * k / 2^F), k = 1..2^F.
    """
    magnitude_bits = 7 if signed else 8
    magnitudes = [0.0]
    for exponent in range(magnitude_bits):
        fraction_bits = magnitude_bits - 1 - exponent
        steps = torch.arange(1, 2**fraction_bits + 1, dtype=torch.float64) / 2**fraction_bits
        magnitudes += (10.0**-exponent * (0.1 + 0.9 * steps)).tolist()
    values = torch.tensor(magnitudes, dtype=torch.float64)
    if signed:
        values = torch.cat([-values[1:], values])
    return values.sort().values.to(torch.float32)


_CODES: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _code_and_midpoints(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (signed, device)
    if key not in _CODES:
        code = dynamic_code(signed).to(device)
        _CODES[key] = (code, (code[1:] + code[:-1]) / 2)
    return _CODES[key]


def _padded_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n] -> [ceil(n / block_size), block_size], the tail block padded with zeros."""
    pad = -flat.numel() % block_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)


_NEAREST: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _nearest_tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The lookup `nearest_code` reads, by the top 16 bits of an fp32 value (sign, exponent and 7
    mantissa bits; a "prefix", offset by 2^15 to index from 0): (below uint8 [2^16], the number of
    midpoints below every value of the prefix; next fp32 [2^16], the first midpoint at or above the
    prefix's least value, +inf where none). No prefix's values straddle two midpoints (checked here:
    in [0.5, 1), where prefixes are widest, they span 2^-8 and the midpoints lie 0.9 / 2^7 apart),
    so a value's count of midpoints below it is below + (value > next)."""
    key = (signed, device)
    if key not in _NEAREST:
        _, midpoints = _code_and_midpoints(signed, torch.device("cpu"))
        low = torch.arange(-2**15, 2**15, dtype=torch.int32) << 16
        ends = (low.view(torch.float32), (low | 0xFFFF).view(torch.float32))  # a prefix's first and last value
        least, most = torch.minimum(*ends), torch.maximum(*ends)
        finite = least.isfinite() & most.isfinite()
        least, most = torch.where(finite, least, 0.0), torch.where(finite, most, 0.0)
        below = torch.bucketize(least, midpoints)  # midpoints < least
        assert int((torch.bucketize(most, midpoints, right=True) - below).max()) <= 1, "a prefix holds two midpoints"
        next_midpoint = torch.cat([midpoints, torch.tensor([math.inf])])[below]
        _NEAREST[key] = below.to(torch.uint8).to(device), next_midpoint.to(device)
    return _NEAREST[key]


def nearest_code(normed: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 index of the code value nearest each element of `normed` (fp32 in [-1, 1], or [0, 1]
    unsigned; ties to the lower code): torch.bucketize(normed, midpoints) exactly, by two table
    reads a value (`_nearest_tables`) instead of a binary search over the 254 or 255 midpoints."""
    below, next_midpoint = _nearest_tables(signed, normed.device)
    prefix = (normed.contiguous().view(torch.int32) >> 16).long().add_(2**15)
    return torch.take(below, prefix).add_(torch.take(next_midpoint, prefix) < normed)


def quantize_blockwise(x: torch.Tensor, block_size: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float, any shape, n elements) -> (codes uint8 [n], absmax fp32 [ceil(n / block_size)]).

    Each element maps to the nearest code value of x / absmax(its block); an all-zero block keeps
    absmax 0 and decodes to zeros. Unsigned codes clamp negative inputs to 0.
    """
    blocks = _padded_blocks(x.reshape(-1).float(), block_size)
    absmax = blocks.abs().amax(dim=1)
    normed = (blocks / torch.where(absmax > 0, absmax, 1.0)[:, None]).clamp_(-1.0 if signed else 0.0, 1.0)
    return nearest_code(normed, signed).view(-1)[: x.numel()], absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, block_size: int,
                         signed: bool) -> torch.Tensor:
    """(codes uint8 [n], absmax fp32 [num_blocks]) -> fp32 [n]."""
    code, _ = _code_and_midpoints(signed, codes.device)
    values = _padded_blocks(torch.take(code, codes.long()), block_size) * absmax[:, None]
    return values.view(-1)[: codes.numel()]


def adamw8bit_step_torch(p, grad, codes_m, absmax_m, codes_r, absmax_r, *, block_size, lr, beta1, beta2, eps,
                         weight_decay, step) -> None:
    """One 8-bit AdamW step of one tensor in place (inputs as ``adamw8bit_step`` checks them): p and
    grad of n elements (any float dtype); codes uint8 [n], absmax fp32 [ceil(n / block_size)]. The
    update is torch.optim.AdamW's single-tensor arithmetic on the dequantised moments, in fp32."""
    param = p.detach().reshape(-1).float()  # p itself when p is fp32 and contiguous
    g = grad.reshape(-1).float()
    exp_avg = dequantize_blockwise(codes_m, absmax_m, block_size, signed=True)
    sqrt_exp_avg_sq = dequantize_blockwise(codes_r, absmax_r, block_size, signed=False)
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq = sqrt_exp_avg_sq.square_().mul_(beta2).addcmul_(g, g, value=1 - beta2)
    sqrt_exp_avg_sq = exp_avg_sq.sqrt_()
    step_size, bias_correction2_sqrt = adamw_step_scalars(lr, beta1, beta2, step)
    denom = (sqrt_exp_avg_sq / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    p.copy_(param.view_as(p))
    for codes, absmax, value, signed in ((codes_m, absmax_m, exp_avg, True),
                                         (codes_r, absmax_r, sqrt_exp_avg_sq, False)):
        new_codes, new_absmax = quantize_blockwise(value, block_size, signed)
        codes.copy_(new_codes)
        absmax.copy_(new_absmax)


# --- CPU step -------------------------------------------------------------------------------------

# The CPU step's piece: on a 2-core CPU, pieces of 2^18 elements ran the step fastest of 2^14..2^22.
CPU_CHUNK_ELEMENTS = 1 << 18


def adamw8bit_step_cpu(p, grad, codes_m, absmax_m, codes_r, absmax_r, *, block_size, lr, beta1, beta2, eps,
                       weight_decay, step, chunk_elements: int = CPU_CHUNK_ELEMENTS) -> None:
    """``adamw8bit_step_torch``'s step, bit for bit, for CPU tensors: the reference on pieces of whole
    blocks of about `chunk_elements` elements (a block's update depends on that block alone), so
    each piece's temporaries stay in the CPU's caches and come from the allocator's free lists
    instead of fresh pages (the reference's n-element temporaries cost a page fault every 4 KiB),
    where the process's heap keeps freed pieces (student.host_heap; the trainer's process does). Its
    many short parallel regions want the main thread's OpenMP team spinning, the process's only one
    (student.host_threads)."""
    n = p.numel()
    if n == 0:
        return
    per = min(max(1, chunk_elements // block_size), -(-n // block_size)) * block_size
    work = p.detach().reshape(-1)  # p itself when contiguous
    g = grad.reshape(-1)
    for start in range(0, n, per):
        end = min(start + per, n)
        blocks = slice(start // block_size, -(-end // block_size))
        adamw8bit_step_torch(work[start:end], g[start:end], codes_m[start:end], absmax_m[blocks], codes_r[start:end],
                             absmax_r[blocks], block_size=block_size, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decay=weight_decay, step=step)
    if work.data_ptr() != p.data_ptr():  # p was not contiguous: reshape copied it
        p.copy_(work.view_as(p))


# --- Triton step ----------------------------------------------------------------------------------
#
# A launch covers tensors that share param dtype, grad dtype, alignment, block_size and one set of
# hyperparameters. Meta columns per tensor: the addresses of p, codes_m, absmax_m, codes_r and
# absmax_r, numel and the number of blocks. A program updates TILE_B whole blocks, a
# [TILE_B, BLOCK_PAD] tile. The arithmetic repeats the torch reference op for op as torch's CPU
# kernels round it (fp contraction off; an fma where the vectorised lerp and addcmul have one) with
# IEEE sqrt and division. The two still differ by an ulp now and then: torch's fp32 sqrt on a CPU
# is not always correctly rounded, torch's CUDA addcmul rounds g * g first; where such an ulp moves
# a moment across a code midpoint, that element's code differs by one step (tests/test_adam8bit.py
# states the tolerances and measures the rates).

_KERNEL_TABLES: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _kernel_tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(code values fp32 [256], midpoints fp32 [256]) for the kernel: the midpoints padded with +inf,
    so that 8 halving steps count the midpoints below a value, as torch.bucketize does."""
    key = (signed, device)
    if key not in _KERNEL_TABLES:
        code, midpoints = _code_and_midpoints(signed, torch.device("cpu"))
        code = torch.cat([code, code.new_zeros(256 - code.numel())])
        midpoints = torch.cat([midpoints, midpoints.new_full((256 - midpoints.numel(),), math.inf)])
        _KERNEL_TABLES[key] = (upload(code, torch.float32, device), upload(midpoints, torch.float32, device))
    return _KERNEL_TABLES[key]


if triton is not None:

    @triton.jit
    def _quantize(x, mid_ptr, LOW: tl.constexpr):
        """x [TILE_B, BLOCK_PAD] (padding lanes 0) -> (codes uint8, absmax fp32 [TILE_B]), as
        quantize_blockwise: nearest code of x / absmax, found as torch.bucketize finds it."""
        absmax = tl.max(tl.abs(x), axis=1)
        normed = tl.div_rn(x, tl.where(absmax > 0, absmax, 1.0)[:, None])
        normed = tl.minimum(tl.maximum(normed, LOW), 1.0)
        # torch.bucketize (right=False): the number of midpoints strictly below the value.
        index = tl.zeros(normed.shape, dtype=tl.int32)
        for shift in tl.static_range(7, -1, -1):
            below = tl.load(mid_ptr + index + ((1 << shift) - 1)) < normed
            index = tl.where(below, index + (1 << shift), index)
        return index.to(tl.uint8), absmax

    @triton.jit
    def _adam8bit_tile(p_ptr, g_ptr, codes_m_ptr, absmax_m_ptr, codes_r_ptr, absmax_r_ptr, first_block, numel,
                       num_blocks, code_m_ptr, mid_m_ptr, code_r_ptr, mid_r_ptr, decay_factor, lerp_weight, beta2,
                       one_minus_beta2, neg_step_size, bias_correction2_sqrt, eps, BLOCK: tl.constexpr,
                       BLOCK_PAD: tl.constexpr, TILE_B: tl.constexpr, MASKED: tl.constexpr,
                       SMALL_WEIGHT: tl.constexpr, ROUND_BF16: tl.constexpr):
        b_local = tl.arange(0, TILE_B)
        j = tl.arange(0, BLOCK_PAD)
        blocks = first_block + b_local
        base = first_block * BLOCK
        offs = b_local[:, None] * BLOCK + j[None, :]  # from base
        if MASKED:
            block_mask = blocks < num_blocks
            mask = (j < BLOCK)[None, :] & ((base + offs) < numel)
            param = tl.load(p_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
            grad = tl.load(g_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
            codes_m = tl.load(codes_m_ptr + base + offs, mask=mask, other=0)
            codes_r = tl.load(codes_r_ptr + base + offs, mask=mask, other=0)
            absmax_m = tl.load(absmax_m_ptr + blocks, mask=block_mask, other=0.0)
            absmax_r = tl.load(absmax_r_ptr + blocks, mask=block_mask, other=0.0)
        else:
            param = tl.load(p_ptr + base + offs).to(tl.float32)
            grad = tl.load(g_ptr + base + offs).to(tl.float32)
            codes_m = tl.load(codes_m_ptr + base + offs)
            codes_r = tl.load(codes_r_ptr + base + offs)
            absmax_m = tl.load(absmax_m_ptr + blocks)
            absmax_r = tl.load(absmax_r_ptr + blocks)
        exp_avg = tl.load(code_m_ptr + codes_m.to(tl.int32)) * absmax_m[:, None]
        sqrt_exp_avg_sq = tl.load(code_r_ptr + codes_r.to(tl.int32)) * absmax_r[:, None]
        if MASKED:  # padding lanes hold 0 as in quantize_blockwise (a code of 0 decodes to -absmax for m)
            exp_avg = tl.where(mask, exp_avg, 0.0)
            sqrt_exp_avg_sq = tl.where(mask, sqrt_exp_avg_sq, 0.0)

        param = param * decay_factor
        # torch's vectorised lerp: fma(w, end - self, self) for w < 0.5, else fma(w - 1, end - self, end).
        if SMALL_WEIGHT:
            exp_avg = tl.fma(lerp_weight, grad - exp_avg, exp_avg)
        else:
            exp_avg = tl.fma(lerp_weight - 1.0, grad - exp_avg, grad)
        exp_avg_sq = sqrt_exp_avg_sq * sqrt_exp_avg_sq
        exp_avg_sq = exp_avg_sq * beta2
        exp_avg_sq = tl.fma(one_minus_beta2 * grad, grad, exp_avg_sq)  # torch's addcmul: one fma
        sqrt_exp_avg_sq = tl.sqrt_rn(exp_avg_sq)
        denom = tl.div_rn(sqrt_exp_avg_sq, bias_correction2_sqrt) + eps
        param = param + tl.div_rn(neg_step_size * exp_avg, denom)  # torch's addcdiv: p + (value * m) / d
        if ROUND_BF16:
            param = to_bf16_rtne(param)
        else:
            param = param.to(p_ptr.dtype.element_ty)
        codes_m, absmax_m = _quantize(exp_avg, mid_m_ptr, -1.0)
        codes_r, absmax_r = _quantize(sqrt_exp_avg_sq, mid_r_ptr, 0.0)
        if MASKED:
            tl.store(p_ptr + base + offs, param, mask=mask)
            tl.store(codes_m_ptr + base + offs, codes_m, mask=mask)
            tl.store(codes_r_ptr + base + offs, codes_r, mask=mask)
            tl.store(absmax_m_ptr + blocks, absmax_m, mask=block_mask)
            tl.store(absmax_r_ptr + blocks, absmax_r, mask=block_mask)
        else:
            tl.store(p_ptr + base + offs, param)
            tl.store(codes_m_ptr + base + offs, codes_m)
            tl.store(codes_r_ptr + base + offs, codes_r)
            tl.store(absmax_m_ptr + blocks, absmax_m)
            tl.store(absmax_r_ptr + blocks, absmax_r)

    @triton.jit
    def _adam8bit_kernel(meta_ptr, grad_addr_ptr, tile_owner_ptr, code_m_ptr, mid_m_ptr, code_r_ptr, mid_r_ptr,
                         decay_factor, lerp_weight, beta2, one_minus_beta2, neg_step_size, bias_correction2_sqrt, eps,
                         P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_PAD: tl.constexpr,
                         TILE_B: tl.constexpr, ALIGN: tl.constexpr, SMALL_WEIGHT: tl.constexpr,
                         ROUND_BF16: tl.constexpr):
        owner, row, tile = locate_tile(meta_ptr, tile_owner_ptr)
        p_ptr = as_pointer(tl.load(row), P_DTYPE)
        codes_m_ptr = as_pointer(tl.load(row + 1), "u8")
        absmax_m_ptr = as_pointer(tl.load(row + 2), "fp32")
        codes_r_ptr = as_pointer(tl.load(row + 3), "u8")
        absmax_r_ptr = as_pointer(tl.load(row + 4), "fp32")
        g_ptr = as_pointer(tl.load(grad_addr_ptr + owner), G_DTYPE)
        if ALIGN > 1:  # here, not in a helper: a hint returned from a called function is lost
            p_ptr = tl.multiple_of(p_ptr, ALIGN)
            g_ptr = tl.multiple_of(g_ptr, ALIGN)
            codes_m_ptr = tl.multiple_of(codes_m_ptr, ALIGN)
            codes_r_ptr = tl.multiple_of(codes_r_ptr, ALIGN)
            absmax_m_ptr = tl.multiple_of(absmax_m_ptr, ALIGN)
            absmax_r_ptr = tl.multiple_of(absmax_r_ptr, ALIGN)
        numel = tl.load(row + 5)
        num_blocks = tl.load(row + 6)
        first_block = tile * TILE_B
        # Whole blocks of a power-of-two size and not the tensor's last tile: no masks, vector loads.
        if BLOCK == BLOCK_PAD and (first_block + TILE_B) * BLOCK <= numel:
            _adam8bit_tile(p_ptr, g_ptr, codes_m_ptr, absmax_m_ptr, codes_r_ptr, absmax_r_ptr, first_block, numel,
                           num_blocks, code_m_ptr, mid_m_ptr, code_r_ptr, mid_r_ptr, decay_factor, lerp_weight,
                           beta2, one_minus_beta2, neg_step_size, bias_correction2_sqrt, eps, BLOCK, BLOCK_PAD,
                           TILE_B, False, SMALL_WEIGHT, ROUND_BF16)
        else:
            _adam8bit_tile(p_ptr, g_ptr, codes_m_ptr, absmax_m_ptr, codes_r_ptr, absmax_r_ptr, first_block, numel,
                           num_blocks, code_m_ptr, mid_m_ptr, code_r_ptr, mid_r_ptr, decay_factor, lerp_weight,
                           beta2, one_minus_beta2, neg_step_size, bias_correction2_sqrt, eps, BLOCK, BLOCK_PAD,
                           TILE_B, True, SMALL_WEIGHT, ROUND_BF16)


def adamw8bit_launch_key(p, grad, codes_m, absmax_m, codes_r, absmax_r, settings: AdamW8bitStepSettings) -> tuple:
    """What tensors must share to go in one launch: (p dtype, grad dtype, aligned, device)."""
    aligned = is_aligned((p, grad, codes_m, absmax_m, codes_r, absmax_r), settings.align_bytes)
    return (p.dtype, grad.dtype, aligned, p.device)


class AdamW8bitLaunch:
    """One launch of the Triton step over contiguous tensors with one ``adamw8bit_launch_key``; its
    tables are built here, once, and stay valid while the tensors (not their grads) stay where they are.
    states: per param (codes_m, absmax_m, codes_r, absmax_r)."""

    def __init__(self, params, states, *, block_size: int, grad_dtype: torch.dtype, aligned: bool,
                 settings: AdamW8bitStepSettings):
        assert settings.takes_block(block_size)
        self.params, self.block_size, self.grad_dtype, self.aligned = params, block_size, grad_dtype, aligned
        self.p_dtype = params[0].dtype
        self.block_pad = _nextis_power_of_two(block_size)
        self.tile_b = max(1, settings.tile_elems // self.block_pad)
        self.align = settings.align_bytes if aligned else 1
        self.num_warps = settings.num_warps
        columns, tiles = [], []
        for p, (codes_m, absmax_m, codes_r, absmax_r) in zip(params, states):
            num_blocks = absmax_m.numel()
            columns.append([p.data_ptr(), codes_m.data_ptr(), absmax_m.data_ptr(), codes_r.data_ptr(),
                            absmax_r.data_ptr(), p.numel(), num_blocks])
            tiles.append(-(-num_blocks // self.tile_b))
        device = params[0].device
        self.table = TensorTable(columns, tiles, device)
        self.num_tensors = self.table.num_tensors
        self.code_m, self.mid_m = _kernel_tables(True, device)
        self.code_r, self.mid_r = _kernel_tables(False, device)

    def run(self, grad_addresses: torch.Tensor, *, lr, beta1, beta2, eps, weight_decay, step) -> None:
        """grad_addresses: int64 [num_tensors] on the device, the grads' addresses in param order."""
        if self.table.num_tiles == 0:
            return
        step_size, bias_correction2_sqrt = adamw_step_scalars(lr, beta1, beta2, step)
        lerp_weight = 1 - beta1
        _adam8bit_kernel[(self.table.num_tiles,)](
            self.table.meta, grad_addresses, self.table.tile_owner, self.code_m, self.mid_m, self.code_r, self.mid_r,
            1 - lr * weight_decay, lerp_weight, beta2, 1 - beta2, -step_size, bias_correction2_sqrt, eps,
            P_DTYPE=TRITON_DTYPE_NAMES[self.p_dtype], G_DTYPE=TRITON_DTYPE_NAMES[self.grad_dtype],
            BLOCK=self.block_size, BLOCK_PAD=self.block_pad, TILE_B=self.tile_b, ALIGN=self.align,
            SMALL_WEIGHT=abs(lerp_weight) < 0.5, ROUND_BF16=self.p_dtype == torch.bfloat16,
            num_warps=self.num_warps, enable_fp_fusion=False,
        )


# --- public function ------------------------------------------------------------------------------

def _validate(params, grads, states, block_size, scalars, impl, settings) -> bool:
    """Raise ValueError on a bad input; return whether the Triton step runs."""
    if not isinstance(settings, AdamW8bitStepSettings):
        raise ValueError(f"`settings` must be an AdamW8bitStepSettings, got {type(settings).__name__}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"`block_size` must be a positive int (elements per absmax scale), got {block_size!r}")
    if len(params) != len(grads) or len(params) != len(states):
        raise ValueError(f"params, grads and states must be lists of one length, got {len(params)}, {len(grads)}, "
                         f"{len(states)}")
    for name in ("lr", "eps", "weight_decay"):
        check_number(name, scalars[name], 0.0)
    check_number("beta1", scalars["beta1"], 0.0, 1.0)
    check_number("beta2", scalars["beta2"], 0.0, 1.0)
    check_step(scalars["step"])
    for i, (p, g, state) in enumerate(zip(params, grads, states)):
        if not p.dtype.is_floating_point or not g.dtype.is_floating_point or g.shape != p.shape:
            raise ValueError(f"params[{i}] and grads[{i}] must be float tensors of one shape, got {p.dtype} "
                             f"{tuple(p.shape)} and {g.dtype} {tuple(g.shape)}")
        if len(state) != 4:
            raise ValueError(f"states[{i}] must be (codes_m, absmax_m, codes_r, absmax_r), got {len(state)} tensors")
        num_blocks = -(-p.numel() // block_size)
        for name, t, dtype, numel in (("codes_m", state[0], torch.uint8, p.numel()),
                                      ("absmax_m", state[1], torch.float32, num_blocks),
                                      ("codes_r", state[2], torch.uint8, p.numel()),
                                      ("absmax_r", state[3], torch.float32, num_blocks)):
            if t.dtype != dtype or t.shape != (numel,) or not t.is_contiguous():
                raise ValueError(f"states[{i}]'s {name} must be a contiguous {dtype} tensor of shape ({numel},), "
                                 f"got {t.dtype} {tuple(t.shape)}")
        if len({p.device, g.device, *(t.device for t in state)}) != 1:
            raise ValueError(f"params[{i}], its grad and its state must be on one device")
    if not runs_triton(impl, (*params, *grads)):
        return False
    if settings.takes_block(block_size):
        return True
    if impl == "auto":  # blocks too large for one program's registers take the torch path
        return False
    raise ValueError(f"impl='triton' takes block_size up to {settings.max_block}, got {block_size}; "
                     "use impl='auto' or 'torch', or a smaller block_size")


def adamw8bit_step(params, grads, states, *, block_size: int, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, step: int, impl: str = "auto",
                   settings: AdamW8bitStepSettings | None = None) -> None:
    """One 8-bit AdamW step in place over lists of tensors that share the hyperparameters and step.

    params[i], grads[i]: one shape, n elements (fp32, bf16 or fp16 for the kernel; any float dtype
    for the torch path; any layout); states[i]: (codes_m uint8 [n], absmax_m fp32 [ceil(n / block_size)],
    codes_r uint8 [n], absmax_r fp32 [ceil(n / block_size)]), contiguous, updated in place.
    step: this step's count, 1 at the first. impl: "auto" (the Triton step for CUDA tensors when
    Triton is installed and the kernel takes block_size, else torch) | "triton" (also on the CPU
    under TRITON_INTERPRET=1, for tests) | "torch". settings: the kernel's tiling (default
    ``AdamW8bitStepSettings()``). Strided params and grads take the kernel on contiguous copies.
    The torch path of CPU tensors is ``adamw8bit_step_cpu``.
    """
    settings = AdamW8bitStepSettings() if settings is None else settings
    scalars = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    if not _validate(params, grads, states, block_size, scalars, impl, settings):
        for p, g, state in zip(params, grads, states):
            step_one = adamw8bit_step_cpu if p.device.type == "cpu" else adamw8bit_step_torch
            step_one(p, g, *state, block_size=block_size, **scalars)
        return
    groups: dict[tuple, list] = {}
    for p, g, state in zip(params, grads, states):
        if p.numel() == 0:
            continue
        work, g = p.contiguous(), g.contiguous()
        groups.setdefault(adamw8bit_launch_key(work, g, *state, settings), []).append((p, work, g, state))
    for (_, grad_dtype, aligned, device), members in groups.items():
        launch = AdamW8bitLaunch([w for _, w, _, _ in members], [s for *_, s in members], block_size=block_size,
                                 grad_dtype=grad_dtype, aligned=aligned, settings=settings)
        launch.run(upload([g.data_ptr() for _, _, g, _ in members], torch.int64, device), **scalars)
        for p, work, *_ in members:
            if work is not p:
                p.copy_(work)
