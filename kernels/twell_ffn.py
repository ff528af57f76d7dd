"""ReLU-gated FFN with an L1 penalty on its hidden state, dense (torch) and sparse (Triton) paths.

h = relu(x Wg^T) * (x Wu^T), y = h Wd^T, l1 = sum over dff of |h|, mean over the N tokens (the
released code of "Sparser, Faster, Lighter Transformer Language Models": the caller takes the mean
over layers and adds coef * l1 to its loss). Weights use the nn.Linear layouts: w_gate, w_up
[dff, d], w_down [d, dff].

Torch path ("torch"): plain autograd over dense [N, dff] tensors; the reference and the CPU path.

Triton path ("triton"): the hybrid ELL + backup format of the paper and gather kernels for the
sparse products; see the section below. It saves about a fifth of the dense path's activations,
but on the H200 (d=2048, dff=5632, 131k tokens, bf16) it is slower than dense cuBLAS at every
sparsity measured (at 99%: forward 20.2 ms against 13.9, forward+backward 62.5 against 40.6;
tests/benchmarks/bench_twell_ffn_gpu.py, 2026-11-29).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path needs no Triton
    triton = None

IMPLS = ("auto", "torch", "triton")


@dataclass
class FFNStats:
    """Sparsity statistics of one call, all tensors on x's device (computing them never syncs).

    nnz: fp32 scalar, mean number of non-zeros of h per token (positions where relu(x Wg^T) > 0).
    active: bool [dff], neuron non-zero for at least one token of this call.
    overflow_rows: int64 scalar, rows with more non-zeros than the ELL width (they leave the ELL
        buffer for the dense backup; includes the fallback rows). 0 on the torch path.
    fallback_rows: int64 scalar, overflowing rows beyond the dense backup's capacity, handled by
        the fallback path (gate recomputed from x in backward). 0 on the torch path.
    """

    nnz: torch.Tensor
    active: torch.Tensor
    overflow_rows: torch.Tensor
    fallback_rows: torch.Tensor


def _stats_from_gate(gate_pos_NF: torch.Tensor, overflow_rows, fallback_rows) -> FFNStats:
    counts_N = gate_pos_NF.sum(dim=1, dtype=torch.int64)
    return FFNStats(
        nnz=counts_N.float().mean() if counts_N.numel() else torch.zeros((), device=counts_N.device),
        active=gate_pos_NF.any(dim=0),
        overflow_rows=overflow_rows,
        fallback_rows=fallback_rows,
    )


def relu_gated_ffn_torch(x, w_gate, w_up, w_down):
    """Dense reference: (y [N, d] in x's dtype, l1 fp32 scalar, FFNStats). Autograd does backward."""
    gate_NF = x @ w_gate.t()
    h_NF = torch.relu(gate_NF) * (x @ w_up.t())
    y_ND = h_NF @ w_down.t()
    l1 = h_NF.float().abs().sum(dim=1).mean() if x.shape[0] else h_NF.float().sum()
    zero = torch.zeros((), dtype=torch.int64, device=x.device)
    with torch.no_grad():
        stats = _stats_from_gate(gate_NF > 0, zero, zero.clone())
    return y_ND, l1, stats


def _validate(x, w_gate, w_up, w_down, impl, ell_width, backup_rows, chunk_rows) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be [N, d] (flatten batch and sequence first), got shape {tuple(x.shape)}")
    num_tokens, d_model = x.shape
    if w_gate.dim() != 2 or w_gate.shape[1] != d_model:
        raise ValueError(f"w_gate must be [dff, d={d_model}], got {tuple(w_gate.shape)}")
    d_ff = w_gate.shape[0]
    if tuple(w_up.shape) != (d_ff, d_model):
        raise ValueError(f"w_up must be [dff={d_ff}, d={d_model}] like w_gate, got {tuple(w_up.shape)}")
    if tuple(w_down.shape) != (d_model, d_ff):
        raise ValueError(f"w_down must be [d={d_model}, dff={d_ff}] (nn.Linear layout), got {tuple(w_down.shape)}")
    for name, t in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must match x's dtype and device ({x.dtype}, {x.device}), "
                             f"got ({t.dtype}, {t.device})")
    if ell_width is not None and ell_width < 1:
        raise ValueError(f"ell_width must be >= 1 or None (default 128), got {ell_width}")
    if backup_rows is not None and backup_rows < 0:
        raise ValueError(f"backup_rows must be >= 0 or None (default N/8), got {backup_rows}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1 or None (auto), got {chunk_rows}")
    if impl == "triton":
        if triton is None:
            raise ValueError("impl='triton' needs the triton package (pip install triton), or use impl='torch'")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"impl='triton' takes fp32, bf16 or fp16 inputs, got {x.dtype}; use impl='torch'")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {x.device}; "
                             "use impl='torch'")


def relu_gated_ffn(x, w_gate, w_up, w_down, *, impl: str = "auto", ell_width: int | None = None,
                   backup_rows: int | None = None, chunk_rows: int | None = None):
    """ReLU-gated FFN with its L1 penalty: (y [N, d] in x's dtype, l1 fp32 scalar, FFNStats).

    x: [N, d]; w_gate, w_up: [dff, d]; w_down: [d, dff]; all one dtype and device. y and l1 both
    carry gradients (for x and the three weights). l1 = sum over dff of |h|, mean over N tokens.
    impl: "torch" (dense autograd, anywhere), "triton" (sparse kernels; CUDA, or the CPU under
    TRITON_INTERPRET=1), "auto" (triton for CUDA fp32/bf16/fp16 tensors when triton imports).
    ell_width: non-zeros per row kept in the ELL buffer (default 128); backup_rows: rows with more
    non-zeros that fit the dense backup (default ceil(N/8)); rows beyond it go to the fallback
    path; chunk_rows: tokens per chunk of the gate GEMM and of the weight-gradient GEMMs (bounds
    transient [chunk, dff] memory; default auto). These three only affect the triton path.
    """
    _validate(x, w_gate, w_up, w_down, impl, ell_width, backup_rows, chunk_rows)
    use_triton = x.shape[0] > 0 and w_gate.shape[0] > 0 and (impl == "triton" or (
        impl == "auto" and triton is not None and x.is_cuda
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    ))
    if not use_triton:  # no tokens or no hidden units: nothing for the kernels to do
        return relu_gated_ffn_torch(x, w_gate, w_up, w_down)
    return relu_gated_ffn_triton(x, w_gate, w_up, w_down, ell_width=ell_width, backup_rows=backup_rows,
                                 chunk_rows=chunk_rows)


# ---------------------------------------------------------------------------------------------
# Triton path.
#
# Format (the paper's hybrid training format, built straight from the gate GEMM's output by one
# extra pass; the pass scans each row in tiles of BLOCK_F hidden columns, counts each tile's
# non-zeros (TwELL's per-tile counts) and packs them ELL-style after the previous tiles' ones, so
# the row-compacted buffer is TwELL's tiles concatenated by a prefix sum of the tile counts):
#   count_N  int32 [N]     non-zeros of relu(x Wg^T) in each row;
#   slot_N   int32 [N]     -1: the row lives in the ELL buffer (count <= W); b >= 0: in row b of
#                          the backup; -2: fallback (count > W and the backup was full);
#   ell_idx  int32 [N, W]  column indices, ell_hg / ell_u [N, W] (x's dtype) relu(gate) and up
#                          values at those columns;
#   bk_idx, bk_hg, bk_u [B, dff]: the backup, a full-width row (any count fits) per overflowing row,
#                          B = backup_rows, handed out in order by an atomic counter;
#   fallback rows keep nothing: the forward reads their gate from the transient gate GEMM output
#   and the backward recomputes their gate and up values from x (slow, rare, counted).
# Forward: per token chunk, gate = x Wg^T (cuBLAS, a transient [chunk, dff]) and _pack_kernel
# (plus _fwd_row_kernel on the chunk's fallback rows, which need its gate); then one launch of
# _fwd_row_kernel over all tokens, longest lists first (so the few long rows overlap the many short
# ones), one program per token, a whole d_model row in registers, BLOCK_S non-zeros a step (the
# paper's fused up/down kernel): u = x . Wu[n] (gathered Wu rows, fp32 sums), h = relu(gate) u,
# y += h Wd^T[n] (gathered rows of Wd^T), and the row's sum |h|.
# Backward, per token chunk: _bwd_row_kernel, one program per token, longest lists first:
# dh = dy . Wd^T[n] + grad_l1 sign(h) / N at the pattern, dh_u = dh relu(gate), dh_g = dh u, and
# dx += dh_u Wu[n] + dh_g Wg[n] (or, _DX_BY_GATHER False, dx by one GEMM over [dh_u | dh_g]); it
# scatters h and [dh_u | dh_g] into zeroed [chunk, dff] and [chunk, 2 dff] buffers whose products
# with dy and x (cuBLAS, fp32 accumulation over chunks) give the weight gradients.
# Saved for backward: x, the weights and the format above; never a dense [N, dff] tensor.
# ---------------------------------------------------------------------------------------------

DEFAULT_ELL_WIDTH = 128
_PACK_BLOCK_M = 16
_PACK_BLOCK_F = 256
# elements of one gathered [BLOCK_S, BLOCK_D] weight tile in the row kernels: 4096 (2 non-zeros a
# step at d=2048) measured best on the H200 against 8192 and 16384 (forward 20.2 / 24.8 / 21.1 ms,
# forward+backward 62.5 / 83.0 / 75.5 ms at 99% sparsity, 2026-11-29)
_ROW_TILE = 4096
_ROW_WARPS = 8
# dx from the sparse pattern by gathering Wu / Wg rows (True), or by one cuBLAS GEMM over the
# densified [dh_u | dh_g] chunk (False); the benchmark measures both
_DX_BY_GATHER = True


def _row_blocks(d_model: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_D) of the row kernels: a whole row of d_model per step (BLOCK_D >= d_model),
    and as many non-zeros per step as fit _ROW_TILE (at least 2). Under the interpreter, 32 non-zeros
    a step: fewer Python-level loop trips."""
    block_d = triton.next_power_of_2(d_model)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 32, block_d
    return max(2, min(64, _ROW_TILE // block_d)), block_d


if triton is not None:

    @triton.jit
    def _pack_kernel(g_ptr, count_ptr, slot_ptr, ell_idx_ptr, ell_hg_ptr, bk_idx_ptr, bk_hg_ptr,
                     counter_ptr, active_ptr, row0, C, F, W, CAP,
                     BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
        """Rows [row0 + pid*BLOCK_M, ...) of the chunk's gate [C, F]: counts, ELL, backup, slot."""
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = r < C
        r64 = r.to(tl.int64)
        grow = r64 + row0
        count = tl.zeros([BLOCK_M], dtype=tl.int32)
        for f0 in range(0, F, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            m2 = rmask[:, None] & (cols < F)[None, :]
            g = tl.load(g_ptr + r64[:, None] * F + cols[None, :], mask=m2, other=0.0)
            pos = (g.to(tl.float32) > 0) & m2
            p = pos.to(tl.int32)
            slot = count[:, None] + tl.cumsum(p, axis=1) - 1
            keep = pos & (slot < W)
            cols2 = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.int32) + cols[None, :]
            tl.store(ell_idx_ptr + grow[:, None] * W + slot, cols2, mask=keep)
            tl.store(ell_hg_ptr + grow[:, None] * W + slot, g, mask=keep)
            col_any = tl.max(p, axis=0)
            # every writer stores 1: the race is benign
            tl.store(active_ptr + cols, col_any, mask=col_any > 0)
            count += tl.sum(p, axis=1)
        over = (count > W) & rmask
        num_over = tl.sum(over.to(tl.int32), axis=0)
        slot_row = tl.full([BLOCK_M], -1, dtype=tl.int32)
        if num_over > 0:
            base = tl.atomic_add(counter_ptr, num_over)
            b = base + tl.cumsum(over.to(tl.int32), axis=0) - 1
            in_bk = over & (b < CAP)
            slot_row = tl.where(over, tl.where(in_bk, b, -2), -1)
            b64 = b.to(tl.int64)
            bk_count = tl.zeros([BLOCK_M], dtype=tl.int32)
            for f0 in range(0, F, BLOCK_F):
                cols = f0 + tl.arange(0, BLOCK_F)
                m2 = in_bk[:, None] & (cols < F)[None, :]
                g = tl.load(g_ptr + r64[:, None] * F + cols[None, :], mask=m2, other=0.0)
                pos = (g.to(tl.float32) > 0) & m2
                p = pos.to(tl.int32)
                slot = bk_count[:, None] + tl.cumsum(p, axis=1) - 1
                cols2 = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.int32) + cols[None, :]
                tl.store(bk_idx_ptr + b64[:, None] * F + slot, cols2, mask=pos)
                tl.store(bk_hg_ptr + b64[:, None] * F + slot, g, mask=pos)
                bk_count += tl.sum(p, axis=1)
        tl.store(count_ptr + grow, count, mask=rmask)
        tl.store(slot_ptr + grow, slot_row, mask=rmask)

    @triton.jit
    def _row_list(m, s, ms, slot, W, F, ell_idx_ptr, ell_hg_ptr, ell_u_ptr, bk_idx_ptr, bk_hg_ptr, bk_u_ptr,
                  LOAD_U: tl.constexpr):
        """Positions s of row m's non-zero list: (column, relu(gate), up, offsets into ELL / backup).
        The forward, which writes the up values, asks for none (LOAD_U False: u is 0)."""
        slot_s = tl.zeros_like(s) + slot  # per lane: the interpreter wants block masks
        is_ell = slot_s == -1
        is_bk = slot_s >= 0
        ell_off = m * W + s
        bk_off = slot.to(tl.int64) * F + s
        n = tl.load(ell_idx_ptr + ell_off, mask=ms & is_ell, other=0) + \
            tl.load(bk_idx_ptr + bk_off, mask=ms & is_bk, other=0)
        hg = tl.load(ell_hg_ptr + ell_off, mask=ms & is_ell, other=0.0).to(tl.float32) + \
            tl.load(bk_hg_ptr + bk_off, mask=ms & is_bk, other=0.0).to(tl.float32)
        u = tl.zeros_like(hg)
        if LOAD_U:
            u = tl.load(ell_u_ptr + ell_off, mask=ms & is_ell, other=0.0).to(tl.float32) + \
                tl.load(bk_u_ptr + bk_off, mask=ms & is_bk, other=0.0).to(tl.float32)
        return n, hg, u, ell_off, bk_off

    @triton.jit
    def _fwd_row_kernel(x_ptr, wu_ptr, wdt_ptr, g_ptr, order_ptr, count_ptr, slot_ptr, ell_idx_ptr, ell_hg_ptr,
                        ell_u_ptr, bk_idx_ptr, bk_hg_ptr, bk_u_ptr, y_ptr, l1_ptr, row0, D, F, W,
                        FALLBACK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        """One token, BLOCK_S non-zeros a step: u = x . Wu[n], h = relu(gate) u, y += h Wd^T[n], sum |h|.

        FALLBACK=False: program i takes token order[i] (longest lists first) and skips fallback
        rows; FALLBACK=True: program i takes token row0 + i of the chunk whose gate is g_ptr and
        does only fallback rows (their gate read from g, all dff columns scanned).
        BLOCK_D >= D: x's row, y's accumulator and each gathered weight row live in registers.
        """
        pid = tl.program_id(0).to(tl.int64)
        if FALLBACK:
            r = pid
            m = row0 + pid
        else:
            r = pid * 0
            m = tl.load(order_ptr + pid).to(tl.int64)
        slot = tl.load(slot_ptr + m)
        is_fb = slot == -2
        mine = is_fb == FALLBACK
        num = tl.where(mine, tl.where(is_fb, F, tl.load(count_ptr + m)), 0)
        dtype = x_ptr.dtype.element_ty
        k = tl.arange(0, BLOCK_D)
        mine_k = (tl.zeros_like(k) + mine.to(tl.int32)) > 0
        mk = (k < D) & mine_k
        xk = tl.load(x_ptr + m * D + k, mask=mk, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        l1 = tl.zeros([BLOCK_S], dtype=tl.float32)
        for s0 in range(0, num, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            ms = s < num
            n, hg, _, ell_off, bk_off = _row_list(m, s, ms, slot, W, F, ell_idx_ptr, ell_hg_ptr, ell_u_ptr,
                                                  bk_idx_ptr, bk_hg_ptr, bk_u_ptr, LOAD_U=False)
            slot_s = tl.zeros_like(s) + slot
            fb_s = slot_s == -2
            g_fb = tl.load(g_ptr + r * F + s, mask=ms & fb_s, other=0.0).to(tl.float32)
            n64 = tl.where(fb_s, s, n).to(tl.int64)
            hg = tl.where(fb_s, tl.maximum(g_fb, 0.0), hg)
            m2 = (ms & (hg > 0))[:, None] & mk[None, :]
            w_u = tl.load(wu_ptr + n64[:, None] * D + k[None, :], mask=m2, other=0.0).to(tl.float32)
            w_d = tl.load(wdt_ptr + n64[:, None] * D + k[None, :], mask=m2, other=0.0).to(tl.float32)
            u = tl.sum(w_u * xk[None, :], axis=1).to(dtype)
            h = (hg * u.to(tl.float32)).to(dtype).to(tl.float32)
            l1 += tl.abs(h)
            acc += tl.sum(w_d * h[:, None], axis=0)
            tl.store(ell_u_ptr + ell_off, u, mask=ms & (slot_s == -1))
            tl.store(bk_u_ptr + bk_off, u, mask=ms & (slot_s >= 0))
        tl.store(y_ptr + m * D + k, acc.to(dtype), mask=mk)
        tl.store(l1_ptr + m + tl.arange(0, 1), tl.zeros([1], dtype=tl.float32) + tl.sum(l1, axis=0),
                 mask=(tl.zeros([1], dtype=tl.int32) + mine.to(tl.int32)) > 0)

    @triton.jit
    def _bwd_row_kernel(x_ptr, dy_ptr, wg_ptr, wu_ptr, wdt_ptr, order_ptr, count_ptr, slot_ptr, ell_idx_ptr,
                        ell_hg_ptr, ell_u_ptr, bk_idx_ptr, bk_hg_ptr, bk_u_ptr, l1_scale_ptr, h_ptr, dhug_ptr,
                        dx_ptr, row0, D, F, W,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, COMPUTE_DX: tl.constexpr):
        """One token of the chunk (order: longest lists first), BLOCK_S non-zeros a step:
        dh = dy . Wd^T[n] (+ the L1 term), dh_u = dh relu(gate), dh_g = dh u, scattered with h into
        the chunk's dense rows ([C, F] and [C, 2F]); dx += dh_u Wu[n] + dh_g Wg[n] when COMPUTE_DX
        (else the host takes dx by a GEMM). Fallback rows recompute gate and up from x."""
        r = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
        m = r + row0
        slot = tl.load(slot_ptr + m)
        is_fb = slot == -2
        num = tl.where(is_fb, F, tl.load(count_ptr + m))
        dtype = x_ptr.dtype.element_ty
        l1_scale = tl.load(l1_scale_ptr)
        k = tl.arange(0, BLOCK_D)
        mk = k < D
        dyk = tl.load(dy_ptr + m * D + k, mask=mk, other=0.0).to(tl.float32)
        fb_k = (tl.zeros_like(k) + slot) == -2
        xk = tl.load(x_ptr + m * D + k, mask=mk & fb_k, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s0 in range(0, num, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            ms = s < num
            n, hg, u, _, _ = _row_list(m, s, ms, slot, W, F, ell_idx_ptr, ell_hg_ptr, ell_u_ptr,
                                       bk_idx_ptr, bk_hg_ptr, bk_u_ptr, LOAD_U=True)
            fb_s = (tl.zeros_like(s) + slot) == -2
            n64 = tl.where(fb_s, s, n).to(tl.int64)
            m2 = ms[:, None] & mk[None, :]
            w_d = tl.load(wdt_ptr + n64[:, None] * D + k[None, :], mask=m2, other=0.0).to(tl.float32)
            if COMPUTE_DX:
                m_ug = m2
            else:
                m_ug = m2 & fb_s[:, None]
            w_g = tl.load(wg_ptr + n64[:, None] * D + k[None, :], mask=m_ug, other=0.0).to(tl.float32)
            w_u = tl.load(wu_ptr + n64[:, None] * D + k[None, :], mask=m_ug, other=0.0).to(tl.float32)
            g_re = tl.sum(w_g * xk[None, :], axis=1).to(dtype).to(tl.float32)
            u_re = tl.sum(w_u * xk[None, :], axis=1).to(dtype).to(tl.float32)
            hg = tl.where(fb_s, tl.maximum(g_re, 0.0), hg)
            u = tl.where(fb_s, u_re, u)
            live = ms & (hg > 0)
            h = (hg * u).to(dtype).to(tl.float32)
            sign = tl.where(h > 0, 1.0, tl.where(h < 0, -1.0, 0.0))
            dh_y = tl.sum(w_d * dyk[None, :], axis=1).to(dtype).to(tl.float32)
            dh = (dh_y + l1_scale * sign).to(dtype).to(tl.float32)
            dhu = tl.where(live, (dh * hg).to(dtype).to(tl.float32), 0.0)
            dhg = tl.where(live, (dh * u).to(dtype).to(tl.float32), 0.0)
            tl.store(h_ptr + r * F + n64, h.to(dtype), mask=live)
            tl.store(dhug_ptr + r * 2 * F + n64, dhu.to(dtype), mask=live)
            tl.store(dhug_ptr + r * 2 * F + F + n64, dhg.to(dtype), mask=live)
            if COMPUTE_DX:
                acc += tl.sum(w_u * dhu[:, None] + w_g * dhg[:, None], axis=0)
        if COMPUTE_DX:
            tl.store(dx_ptr + m * D + k, acc.to(dtype), mask=mk)


_POISON_OUTPUTS = False  # tests set this: outputs start as NaN, so an unwritten element fails


def _new_output(shape, dtype, device):
    if _POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _default_chunk_rows(num_tokens: int, d_ff: int) -> int:
    """Tokens per chunk: a [chunk, dff] transient of at most 2^27 elements (256 MiB in bf16)."""
    return max(1, min(num_tokens, (1 << 27) // max(d_ff, 1)))


def _mm_into_fp32(acc, a, b):
    """acc += a @ b with fp32 accumulation, for bf16 / fp16 / fp32 a and b."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda:
        acc += torch.mm(a, b, out_dtype=torch.float32)
    else:
        acc.addmm_(a.float(), b.float())


class _TwellFFNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, ell_width, backup_rows, chunk_rows):
        num_tokens, d_model = x.shape
        d_ff = w_gate.shape[0]
        dev, dtype = x.device, x.dtype
        width, cap, chunk = ell_width, backup_rows, chunk_rows
        count = torch.empty(num_tokens, dtype=torch.int32, device=dev)
        slot = torch.empty(num_tokens, dtype=torch.int32, device=dev)
        ell_idx = torch.empty(num_tokens, width, dtype=torch.int32, device=dev)
        ell_hg = torch.empty(num_tokens, width, dtype=dtype, device=dev)
        ell_u = torch.empty(num_tokens, width, dtype=dtype, device=dev)
        bk_idx = torch.empty(max(cap, 1), d_ff, dtype=torch.int32, device=dev)
        bk_hg = torch.empty(max(cap, 1), d_ff, dtype=dtype, device=dev)
        bk_u = torch.empty(max(cap, 1), d_ff, dtype=dtype, device=dev)
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
        active = torch.zeros(d_ff, dtype=torch.int32, device=dev)
        l1_rows = torch.empty(num_tokens, dtype=torch.float32, device=dev)
        y = _new_output((num_tokens, d_model), dtype, dev)
        w_down_t = w_down.t().contiguous()
        block_s, block_d = _row_blocks(d_model)
        gate = torch.empty(min(chunk, num_tokens), d_ff, dtype=dtype, device=dev)
        for row0 in range(0, num_tokens, chunk):
            rows = min(chunk, num_tokens - row0)
            gate_c = gate[:rows]
            torch.mm(x[row0:row0 + rows], w_gate.t(), out=gate_c)
            _pack_kernel[(triton.cdiv(rows, _PACK_BLOCK_M),)](
                gate_c, count, slot, ell_idx, ell_hg, bk_idx, bk_hg, counter, active, row0, rows, d_ff,
                width, cap, BLOCK_M=_PACK_BLOCK_M, BLOCK_F=_PACK_BLOCK_F)
            _fwd_row_kernel[(rows,)](
                x, w_up, w_down_t, gate_c, count, count, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u, y,
                l1_rows, row0, d_model, d_ff, width, FALLBACK=True, BLOCK_S=block_s, BLOCK_D=block_d,
                num_warps=_ROW_WARPS)
        del gate
        # longest lists first, so that the few long rows overlap the many short ones
        order = torch.argsort(torch.where(slot == -2, -1, count), descending=True)
        _fwd_row_kernel[(num_tokens,)](
            x, w_up, w_down_t, x, order, count, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u, y,
            l1_rows, 0, d_model, d_ff, width, FALLBACK=False, BLOCK_S=block_s, BLOCK_D=block_d,
            num_warps=_ROW_WARPS)
        l1 = l1_rows.sum() / max(num_tokens, 1)
        over = counter[0].to(torch.int64)
        stats = (count.float().mean() if num_tokens else torch.zeros((), device=dev),
                 active.bool(), over, (over - cap).clamp(min=0))
        ctx.save_for_backward(x, w_gate, w_up, w_down, count, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(*stats)
        return (y, l1) + stats

    @staticmethod
    def backward(ctx, grad_y, grad_l1, *unused):
        x, w_gate, w_up, w_down, count, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u = ctx.saved_tensors
        num_tokens, d_model = x.shape
        d_ff = w_gate.shape[0]
        dev, dtype = x.device, x.dtype
        chunk = ctx.chunk
        width = ell_idx.shape[1]
        grad_y = torch.zeros_like(x) if grad_y is None else grad_y.contiguous()
        l1_scale = torch.zeros(1, dtype=torch.float32, device=dev)
        if grad_l1 is not None:
            l1_scale += grad_l1.float() / max(num_tokens, 1)
        w_down_t = w_down.t().contiguous()
        block_s, block_d = _row_blocks(d_model)
        dx = _new_output(x.shape, dtype, dev)
        rows_max = min(chunk, num_tokens)
        h_buf = torch.empty(rows_max, d_ff, dtype=dtype, device=dev)
        dhug_buf = torch.empty(rows_max, 2 * d_ff, dtype=dtype, device=dev)
        w_ug = None if _DX_BY_GATHER else torch.cat([w_up, w_gate], dim=0)  # [2F, d]
        single = rows_max >= num_tokens
        acc_dtype = dtype if single else torch.float32
        dw_ug = torch.zeros(2 * d_ff, d_model, dtype=acc_dtype, device=dev)
        dwd = torch.zeros(d_model, d_ff, dtype=acc_dtype, device=dev)
        for row0 in range(0, num_tokens, chunk):
            rows = min(chunk, num_tokens - row0)
            h_c, dhug_c = h_buf[:rows], dhug_buf[:rows]
            h_c.zero_()
            dhug_c.zero_()
            key = count[row0:row0 + rows]
            order = torch.argsort(torch.where(slot[row0:row0 + rows] == -2, d_ff, key), descending=True)
            _bwd_row_kernel[(rows,)](
                x, grad_y, w_gate, w_up, w_down_t, order, count, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u,
                l1_scale, h_c, dhug_c, dx, row0, d_model, d_ff, width,
                BLOCK_S=block_s, BLOCK_D=block_d, COMPUTE_DX=_DX_BY_GATHER, num_warps=_ROW_WARPS)
            x_c, dy_c = x[row0:row0 + rows], grad_y[row0:row0 + rows]
            if not _DX_BY_GATHER:
                torch.mm(dhug_c, w_ug, out=dx[row0:row0 + rows])
            if single:
                torch.mm(dhug_c.t(), x_c, out=dw_ug)
                torch.mm(dy_c.t(), h_c, out=dwd)
            else:
                _mm_into_fp32(dw_ug, dhug_c.t(), x_c)
                _mm_into_fp32(dwd, dy_c.t(), h_c)
        dwu, dwg = dw_ug[:d_ff], dw_ug[d_ff:]
        return dx, dwg.to(dtype), dwu.to(dtype), dwd.to(dtype), None, None, None


def relu_gated_ffn_triton(x, w_gate, w_up, w_down, *, ell_width=None, backup_rows=None, chunk_rows=None):
    """The sparse path (inputs validated by relu_gated_ffn): same outputs as relu_gated_ffn_torch."""
    num_tokens, _ = x.shape
    d_ff = w_gate.shape[0]
    width = DEFAULT_ELL_WIDTH if ell_width is None else ell_width
    width = min(width, d_ff)
    cap = -(-num_tokens // 8) if backup_rows is None else backup_rows
    chunk = _default_chunk_rows(num_tokens, d_ff) if chunk_rows is None else chunk_rows
    x, w_gate, w_up, w_down = (t.contiguous() for t in (x, w_gate, w_up, w_down))
    y, l1, nnz, active, over, fallback = _TwellFFNFunction.apply(x, w_gate, w_up, w_down, width, cap, chunk)
    return y, l1, FFNStats(nnz=nnz, active=active, overflow_rows=over, fallback_rows=fallback)
