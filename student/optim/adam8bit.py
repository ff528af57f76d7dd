"""AdamW whose two moments live block-wise in 8 bits (bitsandbytes-style block quantisation).

Each parameter's moments are flattened and cut into blocks of `block_size` elements; a block keeps
one fp32 absmax scale and one uint8 code per element. A step dequantises, updates in fp32 exactly
as AdamW does, applies the update with the fp32 moments, then requantises (round to nearest).

The codes (see `dynamic_code`): a "dynamic tree" code, as in Dettmers et al. (8-bit optimizers
via block-wise quantization). Leading zero bits pick a decade 10^-E, the bits after an indicator
bit pick one of 2^F linear steps in (0.1, 1] of that decade. So the precision sits near the block
maximum (which the code holds exactly: 1.0 is a code value) and small values keep their order of
magnitude down to 1e-6 (signed) / 1e-7 (unsigned) of the block maximum instead of rounding to zero
as a linear code would. Precision falls with the decade: in (0.1, 1] the worst rounding error is
0.9 / 2^(F+1) of the block maximum, F = 6 signed and 7 unsigned.

- m (first moment) is signed: a sign bit plus a 7-bit magnitude, 255 distinct values.
- v (second moment) is stored as r = sqrt(v) through the unsigned 8-bit code (256 values). Why
  sqrt: the update divides by sqrt(v) + eps, so quantising r puts the code's relative error
  straight on the quantity used, and r spans half the decades v does (v ~ g^2), so far fewer
  entries fall below the code's smallest value and round to 0, the case that would turn
  m / (sqrt(v) + eps) into m / eps. Measured (30 steps, lr 1e-3, gradient scales log-uniform
  over 4 decades, block 256): largest deviation from fp32 AdamW 12.6 * lr with sqrt(v) stored,
  1.28e4 * lr with v stored through the same code. tests/test_adam8bit.py bounds both codes'
  rounding error and the drift from fp32 AdamW.

Parameters with fewer than `min_8bit_size` elements (norms, biases) keep fp32 moments and follow
torch.optim.AdamW's single-tensor arithmetic op for op, batched with foreach ops over the params
that share a group and a step count.

Two paths for the 8-bit params: the torch functions below (reference, CPU path) and, for CUDA
params when Triton is installed (`fused`), one Triton kernel that dequantises, updates and
requantises each block in one pass, launched once per group of tensors sharing a param group,
dtypes and step count.

State per 8-bit parameter of n elements: codes_m, codes_r (uint8 [n]) and absmax_m, absmax_r
(fp32 [ceil(n / block_size)]), i.e. `adam8bit_state_bytes_formula`; the step count is a Python int
(no tensor, no host sync to read it).
"""

from __future__ import annotations

import math
import os
import warnings

import torch

from student.optim.foam import _ALIGN_BYTES, _DTYPE_NAMES, _aligned, _upload

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path needs no Triton
    triton = None

__all__ = ["AdamW8bit", "adam8bit_state_bytes_formula", "dynamic_code", "quantize_blockwise",
           "dequantize_blockwise"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements one program updates, and the largest block_size the kernel takes (a block must fit in
# one program's registers; larger blocks take the torch path with a warning).
_TILE_ELEMS = 2048
_MAX_KERNEL_BLOCK = 8192


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


_KERNEL_TABLES: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _kernel_tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(code values fp32 [256], midpoints fp32 [256]) for the kernel: the midpoints padded with +inf,
    so that 8 halving steps count the midpoints below a value, as torch.bucketize does."""
    key = (signed, device)
    if key not in _KERNEL_TABLES:
        code, midpoints = _code_and_midpoints(signed, torch.device("cpu"))
        code = torch.cat([code, code.new_zeros(256 - code.numel())])
        midpoints = torch.cat([midpoints, midpoints.new_full((256 - midpoints.numel(),), math.inf)])
        _KERNEL_TABLES[key] = (_to_device(code, device), _to_device(midpoints, device))
    return _KERNEL_TABLES[key]


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def _padded_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n] -> [ceil(n / block_size), block_size], the tail block padded with zeros."""
    pad = -flat.numel() % block_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def quantize_blockwise(x: torch.Tensor, block_size: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float, any shape, n elements) -> (codes uint8 [n], absmax fp32 [ceil(n / block_size)]).

    Each element maps to the nearest code value of x / absmax(its block); an all-zero block keeps
    absmax 0 and decodes to zeros. Unsigned codes clamp negative inputs to 0.
    """
    code, midpoints = _code_and_midpoints(signed, x.device)
    blocks = _padded_blocks(x.reshape(-1).float(), block_size)
    absmax = blocks.abs().amax(dim=1)
    normed = (blocks / torch.where(absmax > 0, absmax, 1.0)[:, None]).clamp_(-1.0 if signed else 0.0, 1.0)
    codes = torch.bucketize(normed, midpoints).to(torch.uint8)
    return codes.view(-1)[: x.numel()], absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, block_size: int,
                         signed: bool) -> torch.Tensor:
    """(codes uint8 [n], absmax fp32 [num_blocks]) -> fp32 [n]."""
    code, _ = _code_and_midpoints(signed, codes.device)
    values = _padded_blocks(code[codes.long()], block_size) * absmax[:, None]
    return values.view(-1)[: codes.numel()]


# --- Triton path: dequantise, update, requantise in one pass, one launch per group of tensors --------
#
# As FOAM's kernel (student/optim/foam.py): a launch covers the 8-bit params of one param group that
# share param dtype, grad dtype and step count; ``meta`` [k, 8] int64 holds the param, codes_m,
# absmax_m, codes_r and absmax_r addresses, numel, number of blocks and first tile of each tensor,
# ``tile_owner`` [num_tiles] int32 which tensor each program updates, the grads' addresses come in
# their own table. A program updates TILE_B whole blocks, a [TILE_B, BLOCK_PAD] tile. The arithmetic
# repeats the torch path op for op as torch's CPU kernels round it (fp contraction off; an fma where
# the vectorised lerp and addcmul have one) with IEEE sqrt and division. The two still differ by an
# ulp now and then: torch's fp32 sqrt on a CPU is not always correctly rounded (17% of results one
# ulp off, measured on the AVX2 CI machine), torch's CUDA addcmul rounds g * g first; and where such
# an ulp moves a moment across a code midpoint, that element's code differs by one step
# (tests/test_adam8bit.py states the tolerances).

if triton is not None:
    from student.optim.foam import _as_pointer, _to_bf16_rtne

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
            param = _to_bf16_rtne(param)
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
                         TILE_B: tl.constexpr, ALIGNED: tl.constexpr, SMALL_WEIGHT: tl.constexpr,
                         ROUND_BF16: tl.constexpr):
        pid = tl.program_id(0)
        owner = tl.load(tile_owner_ptr + pid).to(tl.int64)
        row = meta_ptr + owner * 8
        p_ptr = _as_pointer(tl.load(row), P_DTYPE)
        codes_m_ptr = tl.load(row + 1).to(tl.pointer_type(tl.uint8))
        absmax_m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        codes_r_ptr = tl.load(row + 3).to(tl.pointer_type(tl.uint8))
        absmax_r_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
        g_ptr = _as_pointer(tl.load(grad_addr_ptr + owner), G_DTYPE)
        if ALIGNED:
            p_ptr = tl.multiple_of(p_ptr, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            codes_m_ptr = tl.multiple_of(codes_m_ptr, 16)
            codes_r_ptr = tl.multiple_of(codes_r_ptr, 16)
            absmax_m_ptr = tl.multiple_of(absmax_m_ptr, 16)
            absmax_r_ptr = tl.multiple_of(absmax_r_ptr, 16)
        numel = tl.load(row + 5)
        num_blocks = tl.load(row + 6)
        first_block = (pid - tl.load(row + 7)) * TILE_B
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



class _Launch8bit:
    """One kernel launch over 8-bit params sharing a param group, dtypes and step count."""

    def __init__(self, group_index, p_dtype, g_dtype, aligned, block_size, params, states):
        self.group_index, self.p_dtype, self.g_dtype, self.block_size = group_index, p_dtype, g_dtype, block_size
        self.aligned = aligned
        self.params, self.states = params, states
        self.block_pad = triton.next_power_of_2(block_size)
        self.tile_b = max(1, _TILE_ELEMS // self.block_pad)
        meta, owners, first_tile = [], [], 0
        for i, (p, state) in enumerate(zip(params, states)):
            num_blocks = state["absmax_m"].numel()
            num_tiles = -(-num_blocks // self.tile_b)
            meta += [p.data_ptr(), state["codes_m"].data_ptr(), state["absmax_m"].data_ptr(),
                     state["codes_r"].data_ptr(), state["absmax_r"].data_ptr(), p.numel(), num_blocks, first_tile]
            owners += [i] * num_tiles
            first_tile += num_tiles
        self.num_tiles = first_tile
        device = params[0].device
        self.meta = _upload(meta, torch.int64, device)
        self.tile_owner = _upload(owners, torch.int32, device)
        self.code_m, self.mid_m = _kernel_tables(True, device)
        self.code_r, self.mid_r = _kernel_tables(False, device)

    def run(self, grad_addrs: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        step_size, bias_correction2_sqrt = AdamW8bit._corrections(self.states[0], group)
        lerp_weight = 1 - beta1
        _adam8bit_kernel[(self.num_tiles,)](
            self.meta, grad_addrs, self.tile_owner, self.code_m, self.mid_m, self.code_r, self.mid_r,
            1 - group["lr"] * group["weight_decay"], lerp_weight, beta2, 1 - beta2, -step_size,
            bias_correction2_sqrt, group["eps"],
            P_DTYPE=_DTYPE_NAMES[self.p_dtype], G_DTYPE=_DTYPE_NAMES[self.g_dtype], BLOCK=self.block_size,
            BLOCK_PAD=self.block_pad, TILE_B=self.tile_b, ALIGNED=self.aligned, SMALL_WEIGHT=abs(lerp_weight) < 0.5,
            ROUND_BF16=self.p_dtype == torch.bfloat16, num_warps=8, enable_fp_fusion=False,
        )


def adam8bit_state_bytes_formula(numel: int, block_size: int, min_8bit_size: int) -> int:
    """Bytes of AdamW8bit moment state for one parameter of `numel` elements (step is not a tensor)."""
    if numel < min_8bit_size:
        return 2 * 4 * numel
    return 2 * (numel + 4 * math.ceil(numel / block_size))


def _check(name: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with block-wise 8-bit moments.

    Arguments are torch.optim.AdamW's plus `block_size` (elements per absmax scale) and
    `min_8bit_size` (parameters with fewer elements keep fp32 moments). Parameters may be fp32,
    bf16 or fp16; the arithmetic is fp32 and the result is cast back to the parameter's dtype.
    fused: None picks the Triton kernel for the 8-bit CUDA params when Triton is installed and
    block_size is at most 8192, the torch path otherwise; True always uses the kernel (on a CPU only
    under TRITON_INTERPRET=1, for tests); False never.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, block_size: int = 256,
                 min_8bit_size: int = 4096, fused: bool | None = None):
        _check("fused", fused, fused in (None, True, False), "None, True or False")
        if fused and triton is None:
            raise ValueError("`fused=True` needs the triton package (pip install triton); or pass fused=None")
        self.fused = fused
        self._warned: set[str] = set()
        self._plan = None  # the batched launches of the last step (see _Plan8bit)
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
        too_big = triton is not None and triton.next_power_of_2(group["block_size"]) > _MAX_KERNEL_BLOCK
        if self.fused is None:
            if not p.is_cuda or p.dtype not in _TRITON_DTYPES:
                return False
            if triton is None:
                self._warn_once("AdamW8bit: triton is not installed, CUDA params use the slower torch path")
                return False
            if too_big:
                self._warn_once(f"AdamW8bit: block_size {group['block_size']} is over the kernel's "
                                f"{_MAX_KERNEL_BLOCK}; those params use the slower torch path")
                return False
            return True
        if p.dtype not in _TRITON_DTYPES:
            raise ValueError(f"`fused=True` takes fp32, bf16 or fp16 params, got {p.dtype}; pass fused=None")
        if not p.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"`fused=True` needs CUDA params (or TRITON_INTERPRET=1 set before import), got "
                             f"{p.device}; pass fused=None")
        if too_big:
            raise ValueError(f"`fused=True` takes block_size up to {_MAX_KERNEL_BLOCK}, got {group['block_size']}; "
                             "pass fused=None or a smaller block_size")
        return True

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        state["step"] = 0
        if p.numel() < group["min_8bit_size"]:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        else:
            num_blocks = math.ceil(p.numel() / group["block_size"])
            for name in ("m", "r"):
                state[f"codes_{name}"] = torch.zeros(p.numel(), dtype=torch.uint8, device=p.device)
                state[f"absmax_{name}"] = torch.zeros(num_blocks, dtype=torch.float32, device=p.device)
        return state

    def _build_plan(self, key: tuple) -> "_Plan8bit":
        """Initialise missing states and sort the params with grads into kernel launches, batched
        fp32-state steps and the per-tensor torch path."""
        launches, small, loose = {}, {}, []
        for group_index, group in enumerate(self.param_groups):
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ValueError("AdamW8bit does not support sparse gradients; use dense gradients")
                state = self.state[p] if self.state[p] else self._init_state(p, group)
                if "exp_avg" in state:
                    small.setdefault((group_index, p.device, state["step"]), []).append((p, state))
                elif self._use_triton(p, group) and p.is_contiguous() and grad.is_contiguous():
                    aligned = _aligned(p, grad, *(state[k] for k in ("codes_m", "absmax_m", "codes_r", "absmax_r")))
                    launch_key = (group_index, p.dtype, grad.dtype, aligned, state["step"])
                    launches.setdefault(launch_key, []).append((p, state))
                else:
                    loose.append((p, state, group))
        built = [_Launch8bit(gi, p_dtype, g_dtype, aligned, self.param_groups[gi]["block_size"],
                             [m[0] for m in members], [m[1] for m in members])
                 for (gi, p_dtype, g_dtype, aligned, _), members in launches.items()]
        small = [(gi, [m[0] for m in members], [m[1] for m in members]) for (gi, _, _), members in small.items()]
        return _Plan8bit(key, built, small, loose)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        key = (id(self.state), tuple(p.grad is not None for p in params), tuple(p.data_ptr() for p in params))
        plan = self._plan
        if plan is None or plan.key != key:
            plan = self._plan = self._build_plan(key)
        if plan.launches:
            grads = [p.grad for p in plan.fused_params]
            addrs = [g.data_ptr() for g in grads]
            dtypes = [g.dtype for g in grads]
            if addrs != plan.grad_addrs or dtypes != plan.grad_dtypes:
                if not plan.grads_fit(grads, addrs, dtypes):
                    plan = self._plan = self._build_plan(key)  # a grad changed dtype or layout: sort again
                    grads = [p.grad for p in plan.fused_params]
                    addrs, dtypes = [g.data_ptr() for g in grads], [g.dtype for g in grads]
                plan.grad_addrs, plan.grad_dtypes = addrs, dtypes
                plan.grad_table = _upload(addrs, torch.int64, plan.fused_params[0].device)
            for state in plan.fused_states:
                state["step"] += 1
            for launch, offset in zip(plan.launches, plan.offsets):
                launch.run(plan.grad_table[offset:offset + len(launch.params)], self.param_groups[launch.group_index])
        for group_index, small_params, states in plan.small:
            for state in states:
                state["step"] += 1
            self._step_fp32(small_params, states, self.param_groups[group_index])
        for p, state, group in plan.loose:
            state["step"] += 1
            self._step_8bit(p, state, group)
        return loss

    @staticmethod
    def _corrections(state: dict, group: dict) -> tuple[float, float]:
        beta1, beta2 = group["betas"]
        step = state["step"]
        return group["lr"] / (1 - beta1**step), math.sqrt(1 - beta2**step)

    def _step_fp32(self, params: list[torch.Tensor], states: list[dict], group: dict) -> None:
        """torch.optim.AdamW's single-tensor arithmetic, op for op, batched over params that share a
        group, a device and a step count (foreach kernels on a GPU, the same ops per tensor on a CPU)."""
        beta1, beta2 = group["betas"]
        lowp = [i for i, p in enumerate(params) if p.dtype != torch.float32]
        param32 = [p.float() if p.dtype != torch.float32 else p for p in params]
        grads = [p.grad.float() for p in params]
        exp_avgs = [state["exp_avg"] for state in states]
        exp_avg_sqs = [state["exp_avg_sq"] for state in states]
        torch._foreach_mul_(param32, 1 - group["lr"] * group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        step_size, bias_correction2_sqrt = self._corrections(states[0], group)
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, bias_correction2_sqrt)
        torch._foreach_add_(denoms, group["eps"])
        torch._foreach_addcdiv_(param32, exp_avgs, denoms, value=-step_size)
        if lowp:
            torch._foreach_copy_([params[i] for i in lowp], [param32[i] for i in lowp])

    def _step_8bit(self, p: torch.Tensor, state: dict, group: dict) -> None:
        beta1, beta2 = group["betas"]
        block_size = group["block_size"]
        param = p.detach().reshape(-1).float()
        grad = p.grad.reshape(-1).float()
        exp_avg = dequantize_blockwise(state["codes_m"], state["absmax_m"], block_size, signed=True)
        sqrt_exp_avg_sq = dequantize_blockwise(state["codes_r"], state["absmax_r"], block_size, signed=False)
        param.mul_(1 - group["lr"] * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq = sqrt_exp_avg_sq.square_().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        sqrt_exp_avg_sq = exp_avg_sq.sqrt_()
        step_size, bias_correction2_sqrt = self._corrections(state, group)
        denom = (sqrt_exp_avg_sq / bias_correction2_sqrt).add_(group["eps"])
        param.addcdiv_(exp_avg, denom, value=-step_size)
        p.copy_(param.view_as(p))
        state["codes_m"], state["absmax_m"] = quantize_blockwise(exp_avg, block_size, signed=True)
        state["codes_r"], state["absmax_r"] = quantize_blockwise(sqrt_exp_avg_sq, block_size, signed=False)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but every state tensor keeps its saved dtype.

        torch casts floating-point state to the parameter's dtype, which would turn uint8 codes
        into floats and round fp32 scales of bf16 parameters.
        """
        super().load_state_dict(state_dict)
        self._plan = None
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)


class _Plan8bit:
    """What one ``AdamW8bit.step`` does for a fixed set of params with grads; reused while ``key``
    (the state dict, which params have grads, the params' addresses) holds."""

    def __init__(self, key, launches, small, loose):
        self.key = key
        self.launches = launches  # list[_Launch8bit]
        self.small = small  # [(group index, params, states)]: fp32 moments, one step count each
        self.loose = loose  # [(param, state, group)]: the torch path
        self.fused_params = [p for launch in launches for p in launch.params]
        self.fused_states = [s for launch in launches for s in launch.states]
        self.planned = [(launch.g_dtype, launch.aligned) for launch in launches for _ in launch.params]
        self.grad_addrs = self.grad_dtypes = self.grad_table = None
        self.offsets = []
        start = 0
        for launch in launches:
            self.offsets.append(start)
            start += len(launch.params)

    def grads_fit(self, grads: list[torch.Tensor], addrs: list[int], dtypes: list[torch.dtype]) -> bool:
        """Whether these grads can take the planned launches (dtype, layout and alignment)."""
        return all(dtype == planned and g.is_contiguous() and (not aligned or addr % _ALIGN_BYTES == 0)
                   for g, addr, dtype, (planned, aligned) in zip(grads, addrs, dtypes, self.planned))
