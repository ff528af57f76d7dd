"""ReLU-gated FFN with an L1 penalty on its hidden state, dense (torch) and sparse (Triton) paths.

h = relu(x Wg^T) * (x Wu^T), y = h Wd^T, l1 = sum over dff of |h|, mean over the N tokens (the
released code of "Sparser, Faster, Lighter Transformer Language Models": the caller takes the mean
over layers and adds coef * l1 to its loss). Weights use the nn.Linear layouts: w_gate, w_up
[dff, d], w_down [d, dff].

Torch path ("torch"): plain autograd over dense [N, dff] tensors; the reference and the CPU path.

Triton path ("triton"): the hybrid ELL + backup format of the paper; the sparse products of the
forward and the backward by blocks of tokens on the tensor cores (with _UNION_FORWARD /
_UNION_BACKWARD off, by gather kernels; all in kernels/twell_ffn_triton.py); see the section
below. On the H200 (d=2048, dff=5632, 131k tokens, bf16; tests/benchmarks/sparse_ffn_real_gpu.py,
bench_twell_ffn_gpu.py, RESULTS.md 2026-11-30) it keeps 0.22x the dense path's activations. On
a trained student's own activations at 99.1% sparsity it runs the forward 1.23-1.31x faster than
dense cuBLAS and forward+backward 1.23-1.29x (four calls), at 98.9% 1.17-1.28x and 1.19-1.23x.
On synthetic inputs (random columns): 1.00x forward and 1.03x forward+backward at 99%, 1.36x /
1.36x at 99.5%; below 99% slower than dense.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None

if triton is not None:  # the kernels, in a file of their own
    from kernels.twell_ffn_triton import (
        _clear_kernel,
        _count_kernel,
        _dh_kernel,
        _fallback_bwd_kernel,
        _fallback_fwd_kernel,
        _scatter_kernel,
        _sddmm_kernel,
        _spmm_kernel,
        _union_dh_kernel,
        _union_down_kernel,
        _union_kernel,
        _union_up_kernel,
    )

IMPLS = ("auto", "torch", "triton")


def _interpreted() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (the tests, on a machine without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


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
        if not x.is_cuda and not _interpreted():
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
# Why the kernels are shaped as they are. At 99% sparsity (56 non-zeros per token at dff 5632)
# the sparse products do 1% of the dense FLOPs, but each non-zero fetches a whole weight row
# (d_model values) that no other non-zero of the token shares: about 0.9x the bytes a dense
# GEMM pulls from L2. So the gather kernels (the SDDMM and SpMM below) are bound by the rate of
# gathering rows from L2: 8.5-9 TB/s on the H200, measured the same for tables of 5.8 to 44 MB
# (bench_twell_ffn_gpu.py's ceiling), and they run near it. Their per-nnz cost is fixed, so they
# win over dense in proportion to the sparsity: level at 99%, 1.4x forward at 99.5%. Rows can
# be shared across tokens: a block of consecutive tokens and the union of their columns, on the
# tensor cores (the forward by blocks, _UNION_FORWARD below). On random columns the union is
# nearly the block's non-zeros, but trained activations share neurons between nearby tokens (a
# real 99% layer: 33 distinct neurons a token in blocks of 16, against 50 non-zeros), so there
# it fetches about a third fewer rows. The gate GEMM stays dense (cuBLAS), as in the paper.
# The pack pass is instruction-bound if it touches every column's list slot: it reads the gate
# once into bit words and per-tile counts (_count_kernel, near copy bandwidth), then walks set
# bits (_scatter_kernel), so its cost follows the non-zeros.
#
# Format (the paper's hybrid training format, written from the gate GEMM's output by _pack):
#   count_N   int32 [N]        non-zeros of relu(x Wg^T) in each row; a row's list is its non-zero
#                              columns in ascending order;
#   start     int32 [NT+1, N]  TwELL's per-tile counts as offsets: position in the row's list where
#                              hidden tile t (_TILE_F columns) starts; start[NT] = count;
#   slot_N    int32 [N]        -1: the whole list is in the ELL buffer (count <= W); b >= 0: list
#                              positions >= W continue in row b of the backup; -2: fallback (count
#                              > W and the backup was full);
#   ell_idx   int32 [N, W], ell_hg / ell_u [N, W] (x's dtype): list positions < W: column,
#                              relu(gate) and up values;
#   bk_idx, bk_hg, bk_u [B, dff - W]: list positions >= W of overflowing rows; B = backup_rows,
#                              handed out in token order (deterministic) to rows with count > W;
#   fallback rows keep nothing usable: the forward reads their gate from the transient gate GEMM
#   output and the backward recomputes their gate and up values from x (slow, rare, counted).
# Forward: per token chunk, gate = x Wg^T (cuBLAS, a transient [chunk, dff]); _pack: per-tile
# counts (_count_kernel), their running sums and the backup rows (torch, on the device), the lists
# (_scatter_kernel); _fallback_fwd_kernel for the chunk's fallback rows (which need its gate). Then
# _sddmm_kernel, grid (token, hidden slice): u = x . Wu[n] at the token's non-zeros in the slice,
# stored in the format, and the row's sum |h| per slice; _spmm_kernel, grid (token, d_model
# slice): y = sum_n round(relu(g) u) Wd^T[n, slice]. Each runs as two launches (_sddmm, _spmm):
# the few longest lists get more programs a row (see _WIDE_ROWS_DIV), every other row one.
# With _UNION_FORWARD, after _pack each chunk goes through _union_forward instead (every row,
# fallback rows too; see the block sizes below), which writes the lists itself (column, relu(g)
# and u, where its up kernel has them at hand): the scatter pass then only gives each word's
# list position (wpos, a transient like the bit words). That took the forward's scatter pass
# from 0.54 to 0.07 ms at 131,072 tokens (H200, RESULTS.md 2026-11-30).
# Backward, per token chunk: dh at the list positions, either from _sddmm_kernel again (dy and
# Wd^T) or, above _DENSE_DH_DENSITY non-zeros (where a gathered row per non-zero costs more than
# the dense product), from cuBLAS's dense dy Wd read at them by _dh_kernel; then (_dh_epilogue)
# dh += the L1 term, dh_u = dh relu(g), dh_g = dh u, scattered with h into zeroed [chunk, dff] and
# [chunk, 2 dff] buffers (zeroed once; _clear_kernel re-zeroes what a chunk wrote) and dh_u, dh_g
# also stored at the list positions; _fallback_bwd_kernel for fallback rows; the weight gradients
# are cuBLAS products of those buffers with dy and x (fp32 accumulation over chunks). After the
# chunks, _spmm_kernel with Wu and Wg: dx = sum_n dh_u Wu[n] + dh_g Wg[n].
# With _UNION_BACKWARD, each chunk goes through _union_backward instead of the dh route and the
# SpMM: per block of tokens, its union columns again (from the bit words, which the forward then
# keeps for every row: dff / 8 bytes a token) and the per-word list positions (the scatter pass
# without its lists); _union_dh_kernel computes dh_y = dy Wd over every (token, union column) pair
# on the tensor cores, reads relu(g) and u at the rows' list positions and writes h, dh_u, dh_g
# into the dense chunk buffers (for the weight-gradient GEMMs, as before) and dh_u, dh_g at the
# union positions; _union_down_kernel with two operands then computes dx = dh_u Wu + dh_g Wg over
# the union columns. Fallback rows are still _fallback_bwd_kernel's.
# Weight gradients by gathers instead (per neuron, its tokens' x and dy rows: the paper's
# transposed format) were tried and measured slower: those rows come from DRAM, not L2 (RESULTS.md).
# Grids put the token index in the fastest dimension, so all tokens pass over one weight slice
# before the next slice starts; tokens run longest lists first.
# Saved for backward: x, the weights, the format above and (by blocks) the bit words; never a
# dense [N, dff] tensor.
# ---------------------------------------------------------------------------------------------

DEFAULT_ELL_WIDTH = 128
# hidden columns per TwELL tile (the paper's T_n; a multiple of 32): a pack program reads one tile
_TILE_F = 256
_COUNT_BLOCK_M = 32  # rows a step of _count_kernel
_SCATTER_BLOCK_M = 64  # rows a step of _scatter_kernel
_PACK_WARPS = 4
# rows a pack program takes (a multiple of both blocks): one store of its active columns per 256
# rows, and a grid whose second dimension stays under CUDA's 65535 for any chunk
_PACK_ROWS = 256
# weight bytes per hidden slice of the SDDMM grid (all tokens pass over one slice of W_up before
# the next). Off by default: the H200's 60 MB L2 holds all 23 MB of W_up, and 12 MB slices cost
# more in re-read x rows than they saved (4.9 vs 4.1 ms at 99%, 2026-11-29); for GPUs with less L2.
_SLICE_BYTES = 1 << 40
# (non-zeros, d_model columns) per step of the SDDMM and SpMM kernels; the SpMM's d_model columns
# are also its slice of W (BLOCK_D x dff weights per slice). Chosen by bench_twell_ffn_gpu.py's
# sweep on the H200 (2026-11-29, at 99%): SDDMM (16, 128) 4.1 ms against 4.2-4.8 for (16, 64),
# (32, 64), (8, 128), (32, 128), (16, 256), and 5.4-8.9 for wider tiles; SpMM (2, 2048) 3.6 ms
# against 3.8 for (4, 2048), 4.1 for (1, 2048), 6.0 for (8, 1024), 7.7+ for narrower slices.
_SDDMM_BLOCKS = (16, 128)
_SPMM_BLOCKS = (2, 2048)
# Lists longer than _LONG_LIST among the first 1/_WIDE_ROWS_DIV of the rows in count order run in
# launches of their own with more programs a row: the SDDMM one per hidden tile, the SpMM one per
# _SPMM_WIDE_BLOCKS[1] columns of d_model. With a program per row, a row of thousands of
# non-zeros holds its program for about a microsecond per non-zero. H200, real trained activations
# at d 2048 / dff 5632 (RESULTS.md, 2026-11-29), two layers with a few rows of 5,600 non-zeros:
# forward 7.7 and 7.0 ms, against 10.0 and 10.7 with the longest row alone in the wide launches;
# the other layers and the synthetic benchmark at 99% within 0.3 ms either way. With every row
# among the longest 1/64 split whatever its length, the synthetic 99% forward lost 0.3 ms.
_WIDE_ROWS_DIV = 512
_LONG_LIST = 512
_SPMM_WIDE_BLOCKS = (32, 128)
_ROW_WARPS = 4  # 8 warps: SpMM 5.6 ms
_DH_BLOCK = 64  # list positions a step of _dh_kernel
_FALLBACK_ROWS = 64  # rows a program of the fallback kernels
# Above this share of non-zeros the backward takes dh from the dense dy Wd (cuBLAS) instead of the
# SDDMM. H200, d 2048, dff 5632, 2026-11-29: at 1% the SDDMM took 6.0 ms, dense + _dh_kernel
# 3.5 + 0.9 ms; at 0.5% the SDDMM ~3 ms. (Set to 0 or 1 to force one path, as the tests do.)
_DENSE_DH_DENSITY = 0.007


# The forward's products over blocks of tokens (_UNION_FORWARD; else the gather SDDMM and SpMM):
# a block of _UNION_BM consecutive tokens takes the union of its rows' non-zero columns, and the
# tensor cores compute u and y over every (token, union column) pair, each weight row fetched
# once a block instead of once per non-zero, but x (or h) re-read for every step of union
# columns. It pays where a block's tokens share neurons, as trained activations do. H200, d 2048
# / dff 5632, 131,072 tokens, bf16 (RESULTS.md, 2026-11-30, three down stages): a trained student's
# layers at 99.1% (50-51 non-zeros a token, 33 distinct neurons a token in blocks of 16): forward
# 11.5-11.6 ms against 12.7-12.8 by the gathers and 14.3 dense (1.236x, 1.245x); at 98.5-98.9%,
# 12.0-13.6 against 13.8-16.9 ms; at 99.4-99.6% (another student, steps of 64 columns) within
# 0.45 ms of the gathers, mostly faster; at 91%, 39 against 73 ms. On random columns with the
# same counts (46-73 distinct neurons a token in blocks of 16) 0.4-1 ms slower than the gathers;
# on the synthetic benchmark 14.3-14.9 against 13.5 ms at 99%, 10.7 against 10.0 at 99.5%. With
# two down stages (_UNION_STAGES): another student's layer at 99.1%, 11.1-11.3 ms against
# 12.8-13.0 by the gathers and 13.9-14.6 dense; synthetic 13.7 ms at 99%, 10.0 at 99.5%. With
# the lists written by the up kernel and its product on wgmma (_rows_times_union): layers at
# 99.0-99.1%, 10.75-10.81 ms against 13.1-13.5 by the gathers and 14.1-14.2 dense; synthetic
# 13.0 ms at 99%, 9.7 at 99.5% (RESULTS.md, 2026-11-30, the lists / wgmma section).
# Settings from sweeps at 99% on random columns: blocks of 16 (32: +2.6 ms, 64: about +5; with
# the up product on wgmma, on a real layer at 99.1%: 32 +1.8 ms, 64 +7.2 ms forward), up
# steps of 128 x 128 (128 x 64: +0.6 ms); the down kernel's steps, warps, stages and programs a
# block moved it by < 0.4 ms. On the real layers, blocks of 32 lost 0.3-0.8 ms forward and
# 0.4-1.3 ms forward+backward though they fetch a fifth fewer rows. A chunk of more than 65535
# blocks (the grids' second dimension) takes the gathers.
# The backward by blocks (_UNION_BACKWARD; H200, same shape, RESULTS.md 2026-11-30), with the
# stages below: on a real layer at 99.1% forward+backward 31.8-32.1 ms against 34.7-35.5 with
# the gather backward and 39.5-41.0 dense; on random columns at 99%, 39.9 against 39.5-39.9 for
# forward and backward by the gathers (at three stages down, 42.7-43.1 against 40.4-40.7 with
# the gather backward: the dx product fetches the rows of two weights, Wu and Wg).
# (union columns, d_model columns) a step of _union_up_kernel; (union columns, d_model columns)
# a step and slice of _union_down_kernel.
_UNION_FORWARD = True
_UNION_BACKWARD = True
_UNION_BM = 16
_UNION_UP_BLOCKS = (128, 128)
_UNION_DOWN_BLOCKS = (64, 256)
_UNION_WARPS = (4, 8)  # up, down
# up (and dh), down (and dx). On the real layers (RESULTS.md, 2026-11-30) the down kernels' two
# stages took 0.3-0.5 ms off the forward and 1.3-2 ms off forward+backward against (3, 3); (2, 2),
# (4, 2), (2, 1), (1, 1) were no better
_UNION_STAGES = (3, 2)
# programs a block in _union_up_kernel, each taking every _UNION_SPLIT-th step of BN union columns
_UNION_SPLIT = 4
# _union_down_kernel's grid with the d_model slices outermost: all blocks pass over one slice of
# the weights before the next. Off: on the H200 the down kernels took the same time either way
# (14.43 against 14.44 ms in forward+backward at 99%, RESULTS.md 2026-11-30); for GPUs with less L2.
_UNION_SLICES_OUTER = False


def _union_blocks(d_model: int) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(BM, up blocks, down blocks); small ones under the interpreter, so the tests' small shapes
    run several blocks, steps and slices (tl.dot needs 16 or more each way)."""
    if _interpreted():
        return 16, (16, 16), (16, 16)
    return _UNION_BM, _UNION_UP_BLOCKS, _UNION_DOWN_BLOCKS


def _blocks(d_model: int, which: str) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_D) of the SDDMM / SpMM kernels; under the interpreter small d_model blocks,
    so the tests' small shapes still run several d_model steps and slices."""
    block_s, block_d = {"sddmm": _SDDMM_BLOCKS, "spmm": _SPMM_BLOCKS, "spmm_wide": _SPMM_WIDE_BLOCKS}[which]
    if _interpreted():
        block_s, block_d = 8, 16
    return block_s, min(block_d, triton.next_power_of_2(d_model))


def _hidden_slices(d_ff: int, d_model: int, elem_bytes: int) -> tuple[int, int]:
    """(slices, tiles per slice) of the SDDMM grid: each slice's weights <= _SLICE_BYTES."""
    num_tiles = triton.cdiv(d_ff, _TILE_F)
    slices = min(num_tiles, max(1, triton.cdiv(d_ff * d_model * elem_bytes, _SLICE_BYTES)))
    per = triton.cdiv(num_tiles, slices)
    return triton.cdiv(num_tiles, per), per


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
    elif a.is_cuda:  # accumulated by cuBLAS (beta = 1): no fp32 temporary and add
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _fallback_blocks(d_model: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_D) of the fallback kernels: a whole d_model row per step."""
    block_d = triton.next_power_of_2(d_model)
    return max(2, min(32, 4096 // block_d)), block_d


def _pack(gate_c, words, wpos, row0, count, slot, start, ell_idx, ell_hg, bk_idx, bk_hg, counter, active, cap,
          lists=True):
    """The chunk's gate [rows, dff] -> its rows of the format (no host sync): per-tile counts
    (_count_kernel, into start[1:]), their running sums over tiles (start), backup rows handed out
    in token order to rows with count > W (counter holds the number handed out so far; beyond cap:
    fallback), then the lists (_scatter_kernel; without `lists` only the words' list positions,
    wpos: the forward by blocks writes the lists itself, in _union_up_kernel)."""
    rows, d_ff = gate_c.shape
    num_tokens, width = ell_idx.shape
    num_tiles = start.shape[0] - 1
    grid = (num_tiles, triton.cdiv(rows, _PACK_ROWS))
    num_words = words.shape[1]
    _count_kernel[grid](gate_c, start[1:], words, active, row0, rows, num_tokens, d_ff, num_words,
                        BLOCK_M=_COUNT_BLOCK_M,
                        ROW_BLOCKS=_PACK_ROWS // _COUNT_BLOCK_M, TILE_F=_TILE_F, num_warps=_PACK_WARPS)
    st = start[:, row0:row0 + rows]
    st[1:] = torch.cumsum(st[1:], dim=0, dtype=torch.int32)
    st[0] = 0
    count[row0:row0 + rows] = st[num_tiles]
    over = st[num_tiles] > width
    b = counter + torch.cumsum(over, dim=0, dtype=torch.int32) - 1
    slot[row0:row0 + rows] = torch.where(over, torch.where(b < cap, b, -2), -1)
    counter += over.sum(dtype=torch.int32)
    _scatter_kernel[grid](gate_c, words, wpos, start, slot, ell_idx, ell_hg, bk_idx, bk_hg, row0, rows, num_tokens,
                          d_ff, width, bk_idx.shape[1], num_words, BLOCK_M=_SCATTER_BLOCK_M,
                          ROW_BLOCKS=_PACK_ROWS // _SCATTER_BLOCK_M,
                          TILE_F=_TILE_F, LISTS=lists, num_warps=_PACK_WARPS)


def _union_forward(x, w_up, w_down_t, gate_c, words, wpos, row0, fmt, ucnt, ucols, h_buf, y):
    """The chunk's y rows and u at its lists by blocks of tokens (see _UNION_FORWARD): each block's
    union columns (_union_kernel), u and h over them (_union_up_kernel), y (_union_down_kernel).
    Every row is computed here, fallback rows too. Returns the chunk's sum of |h| (on the device)."""
    rows, d_ff = gate_c.shape
    d_model = x.shape[1]
    _, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u = fmt
    bm, (bn, bk), (bq, bd) = _union_blocks(d_model)
    nb = triton.cdiv(rows, bm)
    num_words = words.shape[1]
    _union_kernel[(nb,)](words, ucnt, ucols, rows, d_ff, num_words, BM=bm,
                         NWP=triton.next_power_of_2(num_words), num_warps=4)
    l1_part = torch.empty(nb, _UNION_SPLIT, dtype=torch.float32, device=x.device)
    off64 = rows * d_ff >= 2**31
    _union_up_kernel[(_UNION_SPLIT, nb)](
        x, w_up, gate_c, words, wpos, slot, ucnt, ucols, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u, h_buf, l1_part,
        row0, rows, d_model, d_ff, num_words, ell_idx.shape[1], bk_idx.shape[1], BM=bm, BN=bn, BK=bk,
        SPLIT=_UNION_SPLIT, OFF64=off64, UPCAST=_interpreted(), num_warps=_UNION_WARPS[0],
        num_stages=_UNION_STAGES[0])
    _union_down_kernel[_down_grid(d_model, bd, nb)](
        h_buf, w_down_t, h_buf, w_down_t, slot, ucnt, ucols, y, row0, rows, d_model, d_ff, BM=bm, BK=bq, BD=bd,
        TWO=False, SLICES_OUTER=_UNION_SLICES_OUTER, OFF64=off64, UPCAST=_interpreted(), num_warps=_UNION_WARPS[1],
        num_stages=_UNION_STAGES[1])
    return l1_part.sum()


def _down_grid(d_model: int, bd: int, nb: int) -> tuple[int, int]:
    """_union_down_kernel's grid: (d_model slices, blocks), or the other way round (_UNION_SLICES_OUTER)."""
    slices = triton.cdiv(d_model, bd)
    return (nb, slices) if _UNION_SLICES_OUTER else (slices, nb)


def _union_backward(dy, w_gate, w_up, w_down_t, words, wpos, row0, fmt, l1_scale, ucnt, ucols, h_c, dhug_c,
                    dhu_buf, dhg_buf, dx):
    """The chunk's dx rows and its dense h, dh_u, dh_g rows by blocks of tokens (see
    _UNION_BACKWARD): the list positions of each word again (_scatter_kernel without the lists),
    each block's union columns (_union_kernel), dh_y = dy W_down over them and h, dh_u, dh_g at the
    rows' lists (_union_dh_kernel), dx = dh_u W_up + dh_g W_gate over them (_union_down_kernel).
    Fallback rows are left to _fallback_bwd_kernel."""
    rows, d_model = h_c.shape[0], dy.shape[1]
    d_ff = w_gate.shape[0]
    start, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u = fmt
    num_tokens, width = ell_idx.shape
    num_words = words.shape[1]
    grid = (start.shape[0] - 1, triton.cdiv(rows, _PACK_ROWS))
    _scatter_kernel[grid](words, words, wpos, start, slot, ell_idx, ell_hg, bk_idx, bk_hg, row0, rows, num_tokens,
                          d_ff, width, bk_idx.shape[1], num_words, BLOCK_M=_SCATTER_BLOCK_M,
                          ROW_BLOCKS=_PACK_ROWS // _SCATTER_BLOCK_M, TILE_F=_TILE_F, LISTS=False,
                          num_warps=_PACK_WARPS)
    bm, (bn, bk), (bq, bd) = _union_blocks(d_model)
    nb = triton.cdiv(rows, bm)
    _union_kernel[(nb,)](words, ucnt, ucols, rows, d_ff, num_words, BM=bm,
                         NWP=triton.next_power_of_2(num_words), num_warps=4)
    _union_dh_kernel[(_UNION_SPLIT, nb)](
        dy, w_down_t, words, wpos, slot, ucnt, ucols, ell_hg, ell_u, bk_hg, bk_u, l1_scale, h_c, dhug_c, dhu_buf,
        dhg_buf, row0, rows, d_model, d_ff, num_words, width, bk_idx.shape[1], BM=bm, BN=bn, BK=bk,
        SPLIT=_UNION_SPLIT, OFF64=rows * 2 * d_ff >= 2**31, UPCAST=_interpreted(), num_warps=_UNION_WARPS[0],
        num_stages=_UNION_STAGES[0])
    _union_down_kernel[_down_grid(d_model, bd, nb)](
        dhu_buf, w_up, dhg_buf, w_gate, slot, ucnt, ucols, dx, row0, rows, d_model, d_ff, BM=bm, BK=bq, BD=bd,
        TWO=True, SLICES_OUTER=_UNION_SLICES_OUTER, OFF64=rows * d_ff >= 2**31, UPCAST=_interpreted(),
        num_warps=_UNION_WARPS[1], num_stages=_UNION_STAGES[1])


def _wide_rows(rows: int) -> int:
    """How many of `rows` rows, the longest lists first, the wide launches look at."""
    return min(rows, -(-rows // _WIDE_ROWS_DIV))


def _sddmm(a, w, order, fmt, row0, d_model, d_ff, bwd_outs=None):
    """_sddmm_kernel over the rows in `order` (longest lists first): a program per row and hidden
    slice, except for lists over _LONG_LIST among the first _wide_rows, which get a program per
    hidden tile. Forward (bwd_outs None): returns the sum of |h| over the rows (fp32, on the
    device). Backward: bwd_outs = (l1_scale, h, dh_ug, d_ell_u, d_ell_g, d_bk_u, d_bk_g)."""
    start, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u = fmt
    num_tokens, width = ell_idx.shape
    num_tiles = start.shape[0] - 1
    slices, tiles_per_slice = _hidden_slices(d_ff, d_model, a.element_size())
    block_s, block_d = _blocks(d_model, "sddmm")
    wide = _wide_rows(order.numel())
    l1 = torch.zeros((), dtype=torch.float32, device=a.device)
    for rows, grid_s, per, is_wide in ((order.numel(), slices, tiles_per_slice, False), (wide, num_tiles, 1, True)):
        if rows == 0:
            continue
        if bwd_outs is None:
            l1_part = torch.empty(rows, grid_s, dtype=torch.float32, device=a.device)
            outs = (l1_part,) * 8
        else:
            outs = (bwd_outs[0],) + tuple(bwd_outs)
        _sddmm_kernel[(rows, grid_s)](
            a, w, order, start, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u, *outs, row0, num_tokens, d_model,
            d_ff, width, bk_idx.shape[1], num_tiles, per, grid_s, wide, _LONG_LIST, WIDE=is_wide,
            BACKWARD=bwd_outs is not None, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=_ROW_WARPS)
        if bwd_outs is None:
            l1 = l1 + l1_part.sum()
    return l1


def _spmm(w1, w2, order, count, slot, ell_idx, ell_a, ell_b, bk_idx, bk_a, bk_b, out, backward):
    """_spmm_kernel over the rows in `order` (longest lists first): lists over _LONG_LIST among
    the first _wide_rows with narrow d_model slices (more programs a row), the rest as usual."""
    d_model = out.shape[1]
    wide = _wide_rows(order.numel())
    for rows, which in ((order.numel(), "spmm"), (wide, "spmm_wide")):
        if rows == 0:
            continue
        block_s, block_d = _blocks(d_model, which)
        _spmm_kernel[(rows, triton.cdiv(d_model, block_d))](
            w1, w2, order, count, slot, ell_idx, ell_a, ell_b, bk_idx, bk_a, bk_b, out, 0, d_model,
            ell_idx.shape[1], bk_idx.shape[1], wide, _LONG_LIST, WIDE=which == "spmm_wide", BACKWARD=backward,
            BLOCK_S=block_s, BLOCK_D=block_d, num_warps=_ROW_WARPS)


def _host_value_later(t: torch.Tensor):
    """Start copying the device scalar t to the host without waiting; returns a function that
    waits for the copy (done long before, in a training step) and gives its value as an int. On
    the CPU it reads t directly."""
    if not t.is_cuda:
        return lambda: int(t)
    host = torch.empty((), dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def value() -> int:
        copied.synchronize()
        return int(host)

    return value


class _TwellFFNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, ell_width, backup_rows, chunk_rows):
        num_tokens, d_model = x.shape
        d_ff = w_gate.shape[0]
        dev, dtype = x.device, x.dtype
        width, cap, chunk = ell_width, backup_rows, chunk_rows
        bk_width = max(d_ff - width, 1)
        num_tiles = triton.cdiv(d_ff, _TILE_F)
        i32 = dict(dtype=torch.int32, device=dev)
        count, slot = torch.empty(num_tokens, **i32), torch.empty(num_tokens, **i32)
        start = torch.empty(num_tiles + 1, num_tokens, **i32)
        ell_idx = torch.empty(num_tokens, width, **i32)
        ell_hg = torch.empty(num_tokens, width, dtype=dtype, device=dev)
        ell_u = torch.empty(num_tokens, width, dtype=dtype, device=dev)
        bk_idx = torch.empty(max(cap, 1), bk_width, **i32)
        bk_hg = torch.empty(max(cap, 1), bk_width, dtype=dtype, device=dev)
        bk_u = torch.empty(max(cap, 1), bk_width, dtype=dtype, device=dev)
        counter = torch.zeros(1, **i32)
        active = torch.zeros(d_ff, **i32)
        l1_fb = torch.zeros(num_tokens, dtype=torch.float32, device=dev)
        y = _new_output((num_tokens, d_model), dtype, dev)
        w_down_t = w_down.t().contiguous()
        fb_s, fb_d = _fallback_blocks(d_model)
        rows_max = min(chunk, num_tokens)
        gate = torch.empty(rows_max, d_ff, dtype=dtype, device=dev)
        fmt = (start, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u)
        blocks = triton.cdiv(rows_max, _union_blocks(d_model)[0])
        union = _UNION_FORWARD and blocks <= 65535
        union_bwd = _UNION_BACKWARD and blocks <= 65535
        # the bit words: every row's, saved for the backward by blocks; else a chunk's
        num_words = num_tiles * _TILE_F // 32
        words = torch.empty(num_tokens if union_bwd else rows_max, num_words, **i32)
        wpos = torch.empty(rows_max, num_words, **i32)
        if union:  # the union path's transients: a block's columns, h at them
            ucnt, ucols = torch.empty(blocks, **i32), torch.empty(blocks, d_ff, **i32)
            h_buf = torch.empty(rows_max, d_ff, dtype=dtype, device=dev)
            l1_union = torch.zeros((), dtype=torch.float32, device=dev)
        for row0 in range(0, num_tokens, chunk):
            rows = min(chunk, num_tokens - row0)
            gate_c = gate[:rows]
            words_c = words[row0:] if union_bwd else words
            torch.mm(x[row0:row0 + rows], w_gate.t(), out=gate_c)
            _pack(gate_c, words_c, wpos, row0, count, slot, start, ell_idx, ell_hg, bk_idx, bk_hg, counter, active,
                  cap, lists=not union)
            if union:
                l1_union += _union_forward(x, w_up, w_down_t, gate_c, words_c, wpos, row0, fmt, ucnt, ucols, h_buf,
                                           y)
                continue
            _fallback_fwd_kernel[(triton.cdiv(rows, _FALLBACK_ROWS),)](
                x, w_up, w_down_t, gate_c, slot, y, l1_fb, row0, rows, d_model, d_ff, ROWS=_FALLBACK_ROWS,
                BLOCK_S=fb_s, BLOCK_D=fb_d, num_warps=8)
        del gate, wpos
        if not union_bwd:  # nothing to keep (a view would keep the chunk's buffer alive)
            words = words.new_empty(0, num_words)
        if union:
            del ucnt, ucols, h_buf
            l1 = l1_union / max(num_tokens, 1)
        else:
            # longest lists first, so that the few long rows overlap the many short ones
            order = torch.argsort(torch.where(slot == -2, -1, count), descending=True)
            l1_lists = _sddmm(x, w_up, order, fmt, 0, d_model, d_ff)
            _spmm(w_down_t, w_down_t, order, count, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u, y,
                  backward=False)
            l1 = (l1_lists + l1_fb.sum()) / max(num_tokens, 1)
        over = counter[0].to(torch.int64)
        stats = (count.float().mean() if num_tokens else torch.zeros((), device=dev),
                 active.bool(), over, (over - cap).clamp(min=0))
        ctx.save_for_backward(x, w_gate, w_up, w_down, count, slot, start, ell_idx, ell_hg, ell_u,
                              bk_idx, bk_hg, bk_u, words)
        ctx.chunk = chunk
        ctx.union_bwd = union_bwd
        if not union_bwd:  # for the gather backward's choice of dh route
            ctx.nnz_total = _host_value_later(count.sum())
        ctx.mark_non_differentiable(*stats)
        return (y, l1) + stats

    @staticmethod
    def backward(ctx, grad_y, grad_l1, *unused):
        (x, w_gate, w_up, w_down, count, slot, start, ell_idx, ell_hg, ell_u,
         bk_idx, bk_hg, bk_u, words) = ctx.saved_tensors
        num_tokens, d_model = x.shape
        d_ff = w_gate.shape[0]
        dev, dtype = x.device, x.dtype
        chunk = ctx.chunk
        width, bk_width = ell_idx.shape[1], bk_idx.shape[1]
        grad_y = torch.zeros_like(x) if grad_y is None else grad_y.contiguous()
        l1_scale = torch.zeros(1, dtype=torch.float32, device=dev)
        if grad_l1 is not None:
            l1_scale += grad_l1.float() / max(num_tokens, 1)
        w_down_t = w_down.t().contiguous()
        fb_s, fb_d = _fallback_blocks(d_model)
        dx = _new_output(x.shape, dtype, dev)
        rows_max = min(chunk, num_tokens)
        # dh at the non-zeros: a W_down^T row gathered per non-zero (the SDDMM), or, when the
        # non-zeros are dense enough that this costs more than the dense product, dy Wd (cuBLAS)
        # read at them. The choice needs the number of non-zeros on the host. The forward started
        # that copy, so this waits only for the GPU to have passed this layer's forward (long done
        # by now in a training step), not for all the work queued before this backward.
        # By blocks of tokens (ctx.union_bwd) none of this: dh_y over the blocks' union columns.
        union = ctx.union_bwd
        dense_dh = not union and ctx.nnz_total() > _DENSE_DH_DENSITY * num_tokens * d_ff
        dh_buf = torch.empty(rows_max if dense_dh else 0, d_ff, dtype=dtype, device=dev)
        # zeroed once; after each chunk _clear_kernel zeroes only what the chunk wrote
        h_buf = torch.zeros(rows_max, d_ff, dtype=dtype, device=dev)
        dhug_buf = torch.zeros(rows_max, 2 * d_ff, dtype=dtype, device=dev)
        # dh_u, dh_g at the list positions, for the dx SpMM; by blocks, at the union positions
        ell_shape, bk_shape = ((0, 0), (0, 0)) if union else (ell_u.shape, bk_u.shape)
        d_ell_u, d_ell_g = (_new_output(ell_shape, dtype, dev) for _ in range(2))
        d_bk_u, d_bk_g = (_new_output(bk_shape, dtype, dev) for _ in range(2))
        if union:
            blocks = triton.cdiv(rows_max, _union_blocks(d_model)[0])
            i32 = {"dtype": torch.int32, "device": dev}
            ucnt, ucols = torch.empty(blocks, **i32), torch.empty(blocks, d_ff, **i32)
            wpos = torch.empty(rows_max, words.shape[1], **i32)
            dhu_buf, dhg_buf = (torch.empty(rows_max, d_ff, dtype=dtype, device=dev) for _ in range(2))
        single = rows_max >= num_tokens
        acc_dtype = dtype if single else torch.float32
        dw_ug = torch.zeros(2 * d_ff, d_model, dtype=acc_dtype, device=dev)
        dwd = torch.zeros(d_model, d_ff, dtype=acc_dtype, device=dev)
        dh_outs = (h_buf, dhug_buf, d_ell_u, d_ell_g, d_bk_u, d_bk_g)
        fmt = (start, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u)
        for row0 in range(0, num_tokens, chunk):
            rows = min(chunk, num_tokens - row0)
            h_c, dhug_c = h_buf[:rows], dhug_buf[:rows]
            x_c, dy_c = x[row0:row0 + rows], grad_y[row0:row0 + rows]
            if union:
                _union_backward(grad_y, w_gate, w_up, w_down_t, words[row0:], wpos, row0, fmt, l1_scale, ucnt,
                                ucols, h_c, dhug_c, dhu_buf, dhg_buf, dx)
            elif dense_dh:
                dh_c = dh_buf[:rows]
                torch.mm(dy_c, w_down, out=dh_c)
                _dh_kernel[(rows,)](dh_c, count, slot, ell_idx, ell_hg, ell_u, bk_idx, bk_hg, bk_u, l1_scale,
                                    *dh_outs, row0, d_ff, width, bk_width, BLOCK=_DH_BLOCK, num_warps=4)
            else:
                key = torch.where(slot[row0:row0 + rows] == -2, -1, count[row0:row0 + rows])
                _sddmm(grad_y, w_down_t, torch.argsort(key, descending=True), fmt, row0, d_model, d_ff,
                       bwd_outs=(l1_scale, *dh_outs))
            _fallback_bwd_kernel[(triton.cdiv(rows, _FALLBACK_ROWS),)](
                x, grad_y, w_gate, w_up, w_down_t, slot, l1_scale, h_c, dhug_c, dx, row0, rows, d_model, d_ff,
                ROWS=_FALLBACK_ROWS, BLOCK_S=fb_s, BLOCK_D=fb_d, num_warps=8)
            if single:
                torch.mm(dhug_c.t(), x_c, out=dw_ug)
                torch.mm(dy_c.t(), h_c, out=dwd)
            else:
                _mm_into_fp32(dw_ug, dhug_c.t(), x_c)
                _mm_into_fp32(dwd, dy_c.t(), h_c)
            if row0 + rows < num_tokens:
                _clear_kernel[(rows,)](count, slot, ell_idx, bk_idx, h_c, dhug_c, row0, d_ff, width, bk_width,
                                       BLOCK=64)
        del dh_buf, h_buf, dhug_buf, dh_outs
        if not union:
            order = torch.argsort(torch.where(slot == -2, -1, count), descending=True)
            _spmm(w_up, w_gate, order, count, slot, ell_idx, d_ell_u, d_ell_g, bk_idx, d_bk_u, d_bk_g, dx,
                  backward=True)
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
