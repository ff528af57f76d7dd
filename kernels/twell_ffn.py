"""ReLU-gated FFN with an L1 penalty on its hidden state, dense (torch) and sparse (Triton) paths.

h = relu(x Wg^T) * (x Wu^T), y = h Wd^T, l1 = sum over dff of |h|, mean over the N tokens (the
released code of "Sparser, Faster, Lighter Transformer Language Models": the caller takes the mean
over layers and adds coef * l1 to its loss). Weights use the nn.Linear layouts: w_gate, w_up
[dff, d], w_down [d, dff].

Torch path ("torch"): plain autograd over dense [N, dff] tensors; the reference and the CPU path.

Triton path ("triton"): the hybrid ELL + backup format of the paper, packed from a dense gate
GEMM, and the sparse products of the forward and the backward by blocks of consecutive tokens on
the tensor cores (kernels in kernels/twell_ffn_triton.py; the section "Triton path" below says
how and why). It keeps a fraction of the dense path's activations, and it beats dense cuBLAS only
at very high sparsity (around 99% and above) on calls of many tokens, more on a trained
student's activations than on random columns; below that it is slower. RESULTS.md, "Sparse FFN",
holds the measurements (tests/benchmarks/bench_twell_ffn_gpu.py, sparse_ffn_real_gpu.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None

if triton is not None:  # the kernels, in a module of their own that imports nothing of ours
    from kernels.twell_ffn_triton import (
        _clear_kernel,
        _count_kernel,
        _fallback_bwd_kernel,
        _union_dh_kernel,
        _union_down_kernel,
        _union_kernel,
        _union_up_kernel,
        _word_pos_kernel,
    )

IMPLS = ("auto", "torch", "triton")
# ell_width's default: twice the mean non-zeros a token at 99% sparsity and dff 5632, rounded up to
# a power of two, so that most rows fit the ELL buffer and the backup takes the long tail
DEFAULT_ELL_WIDTH = 128


def _interpreted() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (the tests, on a machine without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class TwellSettings:
    """How the Triton path runs (launch shapes and a debug switch); every setting gives the same
    results to rounding. The defaults come from sweeps on the H200 at d 2048 / dff 5632 on
    synthetic and trained activations (RESULTS.md, "Sparse FFN"; the sweeps are in notes/sparse-ffn.md);
    a GPU with less shared memory or L2 may want others.
    """

    # hidden columns per TwELL tile (the paper's T_n): a pack program's columns, 32 bits a word
    tile_f: int = 256
    # rows a step of the count pass (_count_kernel) and of the list-position pass (_word_pos_kernel)
    count_block_m: int = 32
    wpos_block_m: int = 64
    # rows a pack program takes (a multiple of both steps): one store of its tile's active columns
    pack_rows: int = 256
    pack_warps: int = 4
    # tokens a block of the products; 16 is the least tl.dot takes, and larger blocks, though they
    # fetch fewer weight rows on trained activations, measured slower there
    block_m: int = 16
    # (union columns, d_model columns) a step of the up and dh products
    up_blocks: tuple[int, int] = (128, 128)
    # (union columns a step, d_model columns a program) of the down and dx products
    down_blocks: tuple[int, int] = (64, 256)
    # programs a block in the up and dh kernels, each taking every split-th step of union columns
    split: int = 4
    # warps and software-pipeline stages: (up and dh, down and dx)
    warps: tuple[int, int] = (4, 8)
    stages: tuple[int, int] = (3, 2)
    # rows a program of the fallback backward (one launch of N / fallback_rows programs for the rare row)
    fallback_rows: int = 64
    # outputs and intermediate value buffers start as NaN, so an element no kernel wrote shows in
    # the result (the tests set it; it costs a fill per buffer)
    poison: bool = False

    def __post_init__(self):
        for name, (ok, allowed) in _SETTING_RULES.items():
            if not ok(getattr(self, name)):
                raise ValueError(f"TwellSettings.{name} must be {allowed}, got {getattr(self, name)!r}")
        if self.pack_rows % self.count_block_m or self.pack_rows % self.wpos_block_m:
            raise ValueError(f"TwellSettings.pack_rows must be a multiple of count_block_m and wpos_block_m "
                             f"({self.count_block_m}, {self.wpos_block_m}), got {self.pack_rows}")


def _int_at_least(least: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= least


def _power_of_two(least: int = 1):
    return lambda v: _int_at_least(least)(v) and v & (v - 1) == 0


def _pair(ok):
    return lambda v: isinstance(v, tuple) and len(v) == 2 and all(ok(e) for e in v)


_SETTING_RULES = {  # field: (test, what it must be); tl.arange wants powers of two, tl.dot 16 or more
    "tile_f": (_power_of_two(32), "a power of two >= 32"),
    "count_block_m": (_power_of_two(), "a power of two"),
    "wpos_block_m": (_power_of_two(), "a power of two"),
    "pack_rows": (_int_at_least(1), "an int >= 1"),
    "pack_warps": (_power_of_two(), "a power of two"),
    "block_m": (_power_of_two(16), "a power of two >= 16"),
    "up_blocks": (_pair(_power_of_two(16)), "a pair of powers of two >= 16"),
    "down_blocks": (_pair(_power_of_two(16)), "a pair of powers of two >= 16"),
    "split": (_int_at_least(1), "an int >= 1"),
    "warps": (_pair(_power_of_two()), "a pair of powers of two"),
    "stages": (_pair(_int_at_least(1)), "a pair of ints >= 1"),
    "fallback_rows": (_int_at_least(1), "an int >= 1"),
    "poison": (lambda v: isinstance(v, bool), "True or False"),
}


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


def _validate(x, w_gate, w_up, w_down, impl, ell_width, backup_rows, chunk_rows, settings) -> None:
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
        raise ValueError(f"ell_width must be >= 1 or None (default {DEFAULT_ELL_WIDTH}), got {ell_width}")
    if backup_rows is not None and backup_rows < 0:
        raise ValueError(f"backup_rows must be >= 0 or None (default N/8), got {backup_rows}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1 or None (auto), got {chunk_rows}")
    if settings is not None and not isinstance(settings, TwellSettings):
        raise ValueError(f"settings must be a TwellSettings or None (the defaults), got {type(settings).__name__}")
    if impl == "triton":
        if triton is None:
            raise ValueError("impl='triton' needs the triton package (pip install triton), or use impl='torch'")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"impl='triton' takes fp32, bf16 or fp16 inputs, got {x.dtype}; use impl='torch'")
        if not x.is_cuda and not _interpreted():
            raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {x.device}; "
                             "use impl='torch'")


def relu_gated_ffn(x, w_gate, w_up, w_down, *, impl: str = "auto", ell_width: int | None = None,
                   backup_rows: int | None = None, chunk_rows: int | None = None,
                   settings: TwellSettings | None = None):
    """ReLU-gated FFN with its L1 penalty: (y [N, d] in x's dtype, l1 fp32 scalar, FFNStats).

    x: [N, d]; w_gate, w_up: [dff, d]; w_down: [d, dff]; all one dtype and device. y and l1 both
    carry gradients (for x and the three weights). l1 = sum over dff of |h|, mean over N tokens.
    impl: "torch" (dense autograd, anywhere), "triton" (sparse kernels; CUDA, or the CPU under
    TRITON_INTERPRET=1), "auto" (triton for CUDA fp32/bf16/fp16 tensors when triton imports).
    ell_width: non-zeros per row kept in the ELL buffer (default DEFAULT_ELL_WIDTH); backup_rows:
    rows with more non-zeros that fit the dense backup (default ceil(N/8)); rows beyond it go to
    the fallback path; chunk_rows: tokens per chunk of the gate GEMM and of the weight-gradient
    GEMMs (bounds transient [chunk, dff] memory; default auto); settings: the kernels' launch
    settings (default TwellSettings()). These four only affect the triton path.
    """
    _validate(x, w_gate, w_up, w_down, impl, ell_width, backup_rows, chunk_rows, settings)
    use_triton = x.shape[0] > 0 and w_gate.shape[0] > 0 and (impl == "triton" or (
        impl == "auto" and triton is not None and x.is_cuda
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    ))
    if not use_triton:  # no tokens or no hidden units: nothing for the kernels to do
        return relu_gated_ffn_torch(x, w_gate, w_up, w_down)
    return relu_gated_ffn_triton(x, w_gate, w_up, w_down, ell_width=ell_width, backup_rows=backup_rows,
                                 chunk_rows=chunk_rows, settings=settings)


# ---------------------------------------------------------------------------------------------
# Triton path.
#
# Why the kernels are shaped as they are. At 99% sparsity the sparse products do a hundredth of
# the dense FLOPs, but a kernel that gathers one weight row (d_model values) per non-zero moves
# about as many bytes as the dense GEMM: no other non-zero of the token shares that row. So the
# products run by blocks of `block_m` consecutive tokens: each block takes the union of its rows'
# non-zero columns, and the tensor cores compute over every (token, union column) pair, each
# weight row fetched once a block. Trained activations share neurons between nearby tokens, so
# there the union is much smaller than the block's non-zeros; on random columns it is not, which
# is why the kernels gain more on a trained student than on the synthetic benchmark (RESULTS.md,
# "Sparse FFN"). A row-per-non-zero gather design was measured and lost on trained activations (git
# history and the notes keep it). The gate GEMM stays dense (cuBLAS), as in the paper. The pack
# reads the gate once into bit words and per-tile counts, then gives each word its list position,
# so it costs about one read of the gate whatever the sparsity. Weight gradients by gathers (per
# neuron, its tokens' x and dy rows: the paper's transposed format) measured slower than cuBLAS
# over dense buffers: those rows come from DRAM, not L2.
#
# Format (the paper's hybrid training format, built per chunk of tokens):
#   count     int32 [N]        non-zeros of relu(x Wg^T) in each row; a row's list is its non-zero
#                              columns in ascending order;
#   start     int32 [NT+1, N]  TwELL's per-tile counts as offsets: position in the row's list where
#                              hidden tile t (tile_f columns) starts; start[NT] = count;
#   words     int32 [N, NT*tile_f/32]  the gate's positive entries as bits (bit b of word k:
#                              column 32k + b); the backward finds each block's union in them;
#   slot      int32 [N]        -1: the whole list is in the ELL buffer (count <= W); b >= 0: list
#                              positions >= W continue in row b of the backup; -2: fallback (count
#                              > W and the backup was full);
#   ell_idx   int32 [N, W], ell_hg / ell_u [N, W] (x's dtype): list positions < W: column,
#                              relu(gate) and up values;
#   bk_idx, bk_hg, bk_u [B, dff - W]: list positions >= W of overflowing rows; B = backup_rows,
#                              handed out in token order (deterministic) to rows with count > W;
#   fallback rows keep no list: the backward recomputes their gate and up values from x (slow,
#   rare, counted in FFNStats.fallback_rows).
# Forward, per chunk: gate = x Wg^T (cuBLAS, a transient [chunk, dff]); _pack: per-tile counts and
# bit words (_count_kernel), their running sums and the backup rows (torch, on the device), each
# word's list position (_word_pos_kernel); then by blocks (_union_forward): each block's union
# columns (_union_kernel); u = x Wu^T over the union on the tensor cores, h = relu(g) u, and the
# lists (column, relu(g), u) written at the rows' list positions (_union_up_kernel); y = h Wd^T
# over the union (_union_down_kernel). Every row goes this way, fallback rows too.
# Backward, per chunk (_union_backward): the words' list positions and the blocks' unions again;
# dh_y = dy Wd over the union (_union_dh_kernel), relu(g) and u read from the lists, dh = dh_y +
# the L1 term, dh_u = dh relu(g), dh_g = dh u, written with h into zeroed dense [chunk, dff] and
# [chunk, 2 dff] buffers (zeroed once; _clear_kernel re-zeroes what a chunk wrote) and at the
# union positions, from which dx = dh_u Wu + dh_g Wg over the union (_union_down_kernel with two
# operands); fallback rows by _fallback_bwd_kernel; the weight gradients are cuBLAS products of
# the dense buffers with dy and x (fp32 accumulation over chunks).
# Saved for backward: x, the weights and the format above; never a dense [N, dff] tensor.
# ---------------------------------------------------------------------------------------------


class _Format(NamedTuple):
    """The TwELL format of one call (shapes above)."""

    count: torch.Tensor
    slot: torch.Tensor
    start: torch.Tensor
    words: torch.Tensor
    ell_idx: torch.Tensor
    ell_hg: torch.Tensor
    ell_u: torch.Tensor
    bk_idx: torch.Tensor
    bk_hg: torch.Tensor
    bk_u: torch.Tensor

    @staticmethod
    def empty(num_tokens, d_ff, width, cap, dtype, device, settings) -> _Format:
        num_tiles = triton.cdiv(d_ff, settings.tile_f)
        i32 = dict(dtype=torch.int32, device=device)
        bk_shape = (max(cap, 1), max(d_ff - width, 1))
        return _Format(
            count=torch.empty(num_tokens, **i32), slot=torch.empty(num_tokens, **i32),
            start=torch.empty(num_tiles + 1, num_tokens, **i32),
            words=torch.empty(num_tokens, num_tiles * settings.tile_f // 32, **i32),
            ell_idx=torch.empty(num_tokens, width, **i32),
            ell_hg=_values((num_tokens, width), dtype, device, settings),
            ell_u=_values((num_tokens, width), dtype, device, settings),
            bk_idx=torch.empty(bk_shape, **i32),
            bk_hg=_values(bk_shape, dtype, device, settings), bk_u=_values(bk_shape, dtype, device, settings))


def _values(shape, dtype, device, settings: TwellSettings) -> torch.Tensor:
    """A buffer the kernels fill before anything reads it: NaN with settings.poison, else uninitialised."""
    if settings.poison:
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


def _word_positions(fmt: _Format, wpos, row0: int, rows: int, s: TwellSettings) -> None:
    """wpos [rows, num_words] = the list position of each bit word's lowest column (_word_pos_kernel)."""
    num_tiles = fmt.start.shape[0] - 1
    _word_pos_kernel[(num_tiles * triton.cdiv(rows, s.pack_rows),)](
        fmt.words[row0:], wpos, fmt.start, row0, rows, fmt.count.shape[0], fmt.words.shape[1], num_tiles,
        BLOCK_M=s.wpos_block_m, ROW_BLOCKS=s.pack_rows // s.wpos_block_m, TILE_F=s.tile_f, num_warps=s.pack_warps)


def _pack(gate_c, fmt: _Format, wpos, row0, counter, active, cap, s: TwellSettings) -> None:
    """The chunk's gate [rows, dff] -> its rows of the format but the lists (no host sync): per-tile
    counts and bit words (_count_kernel), their running sums over tiles (start), backup rows handed
    out in token order to rows with count > W (counter holds the number handed out so far; beyond
    cap: fallback), and the words' list positions (wpos). _union_up_kernel writes the lists."""
    rows, d_ff = gate_c.shape
    num_tokens, width = fmt.ell_idx.shape
    num_tiles = fmt.start.shape[0] - 1
    _count_kernel[(num_tiles * triton.cdiv(rows, s.pack_rows),)](
        gate_c, fmt.start[1:], fmt.words[row0:], active, row0, rows, num_tokens, d_ff, fmt.words.shape[1],
        num_tiles, BLOCK_M=s.count_block_m, ROW_BLOCKS=s.pack_rows // s.count_block_m, TILE_F=s.tile_f,
        num_warps=s.pack_warps)
    st = fmt.start[:, row0:row0 + rows]
    st[1:] = torch.cumsum(st[1:], dim=0, dtype=torch.int32)
    st[0] = 0
    fmt.count[row0:row0 + rows] = st[num_tiles]
    over = st[num_tiles] > width
    b = counter + torch.cumsum(over, dim=0, dtype=torch.int32) - 1
    fmt.slot[row0:row0 + rows] = torch.where(over, torch.where(b < cap, b, -2), -1)
    counter += over.sum(dtype=torch.int32)
    _word_positions(fmt, wpos, row0, rows, s)


def _unions(words_c, ucnt, ucols, rows: int, d_ff: int, s: TwellSettings) -> int:
    """Each block of s.block_m rows: its union columns into ucols[b, :ucnt[b]]. Returns the blocks."""
    nb = triton.cdiv(rows, s.block_m)
    _union_kernel[(nb,)](words_c, ucnt, ucols, rows, d_ff, words_c.shape[1], BM=s.block_m,
                         NWP=triton.next_power_of_2(words_c.shape[1]), num_warps=4)
    return nb


def _union_forward(x, w_up, w_down_t, gate_c, fmt: _Format, wpos, row0, ucnt, ucols, h_buf, y, s: TwellSettings):
    """The chunk's y rows and its lists by blocks of tokens: each block's union columns, u and h
    over them (_union_up_kernel), y (_union_down_kernel). Every row is computed here, fallback
    rows too. Returns the chunk's sum of |h| (on the device)."""
    rows, d_ff = gate_c.shape
    d_model = x.shape[1]
    words_c = fmt.words[row0:]
    nb = _unions(words_c, ucnt, ucols, rows, d_ff, s)
    (bn, bk), (bq, bd) = s.up_blocks, s.down_blocks
    l1_part = torch.empty(nb * s.split, dtype=torch.float32, device=x.device)
    off64 = rows * d_ff >= 2**31
    _union_up_kernel[(nb * s.split,)](
        x, w_up, gate_c, words_c, wpos, fmt.slot, ucnt, ucols, fmt.ell_idx, fmt.ell_hg, fmt.ell_u, fmt.bk_idx,
        fmt.bk_hg, fmt.bk_u, h_buf, l1_part, row0, rows, d_model, d_ff, words_c.shape[1], fmt.ell_idx.shape[1],
        fmt.bk_idx.shape[1], BM=s.block_m, BN=bn, BK=bk, SPLIT=s.split, OFF64=off64, UPCAST=_interpreted(),
        num_warps=s.warps[0], num_stages=s.stages[0])
    _union_down_kernel[(nb * triton.cdiv(d_model, bd),)](
        h_buf, w_down_t, h_buf, w_down_t, fmt.slot, ucnt, ucols, y, row0, rows, d_model, d_ff, BM=s.block_m,
        BK=bq, BD=bd, TWO=False, OFF64=off64, UPCAST=_interpreted(), num_warps=s.warps[1],
        num_stages=s.stages[1])
    return l1_part.sum()


def _union_backward(dy, w_gate, w_up, w_down_t, fmt: _Format, wpos, row0, l1_scale, ucnt, ucols, h_c, dhug_c,
                    dhu_buf, dhg_buf, dx, s: TwellSettings):
    """The chunk's dx rows and its dense h, dh_u, dh_g rows by blocks of tokens: the words' list
    positions and each block's union columns again, dh_y = dy W_down over them and h, dh_u, dh_g at
    the rows' lists (_union_dh_kernel), dx = dh_u W_up + dh_g W_gate over them
    (_union_down_kernel). Fallback rows are left to _fallback_bwd_kernel."""
    rows, d_model = h_c.shape[0], dy.shape[1]
    d_ff = w_gate.shape[0]
    words_c = fmt.words[row0:]
    _word_positions(fmt, wpos, row0, rows, s)
    nb = _unions(words_c, ucnt, ucols, rows, d_ff, s)
    (bn, bk), (bq, bd) = s.up_blocks, s.down_blocks
    _union_dh_kernel[(nb * s.split,)](
        dy, w_down_t, words_c, wpos, fmt.slot, ucnt, ucols, fmt.ell_hg, fmt.ell_u, fmt.bk_hg, fmt.bk_u, l1_scale,
        h_c, dhug_c, dhu_buf, dhg_buf, row0, rows, d_model, d_ff, words_c.shape[1], fmt.ell_idx.shape[1],
        fmt.bk_idx.shape[1], BM=s.block_m, BN=bn, BK=bk, SPLIT=s.split, OFF64=rows * 2 * d_ff >= 2**31,
        UPCAST=_interpreted(), num_warps=s.warps[0], num_stages=s.stages[0])
    _union_down_kernel[(nb * triton.cdiv(d_model, bd),)](
        dhu_buf, w_up, dhg_buf, w_gate, fmt.slot, ucnt, ucols, dx, row0, rows, d_model, d_ff, BM=s.block_m,
        BK=bq, BD=bd, TWO=True, OFF64=rows * d_ff >= 2**31, UPCAST=_interpreted(), num_warps=s.warps[1],
        num_stages=s.stages[1])


def _fallback_blocks(d_model: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_D) of the fallback kernel: a whole d_model row per step."""
    block_d = triton.next_power_of_2(d_model)
    return max(2, min(32, 4096 // block_d)), block_d


class _TwellFFNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, width, cap, chunk, s):
        num_tokens, d_model = x.shape
        d_ff = w_gate.shape[0]
        dev, dtype = x.device, x.dtype
        fmt = _Format.empty(num_tokens, d_ff, width, cap, dtype, dev, s)
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
        active = torch.zeros(d_ff, dtype=torch.int32, device=dev)
        y = _values((num_tokens, d_model), dtype, dev, s)
        w_down_t = w_down.t().contiguous()
        rows_max = min(chunk, num_tokens)
        gate = torch.empty(rows_max, d_ff, dtype=dtype, device=dev)
        wpos = torch.empty(rows_max, fmt.words.shape[1], dtype=torch.int32, device=dev)
        blocks = triton.cdiv(rows_max, s.block_m)
        ucnt = torch.empty(blocks, dtype=torch.int32, device=dev)
        ucols = torch.empty(blocks, d_ff, dtype=torch.int32, device=dev)
        h_buf = _values((rows_max, d_ff), dtype, dev, s)  # h at the union positions
        l1_sum = torch.zeros((), dtype=torch.float32, device=dev)
        for row0 in range(0, num_tokens, chunk):
            gate_c = gate[:min(chunk, num_tokens - row0)]
            torch.mm(x[row0:row0 + gate_c.shape[0]], w_gate.t(), out=gate_c)
            _pack(gate_c, fmt, wpos, row0, counter, active, cap, s)
            l1_sum += _union_forward(x, w_up, w_down_t, gate_c, fmt, wpos, row0, ucnt, ucols, h_buf, y, s)
        del gate, wpos, ucnt, ucols, h_buf
        over = counter[0].to(torch.int64)
        stats = (fmt.count.float().mean(), active.bool(), over, (over - cap).clamp(min=0))
        ctx.save_for_backward(x, w_gate, w_up, w_down, *fmt)
        ctx.chunk, ctx.settings = chunk, s
        ctx.mark_non_differentiable(*stats)
        return (y, l1_sum / num_tokens) + stats

    @staticmethod
    def backward(ctx, grad_y, grad_l1, *unused):
        x, w_gate, w_up, w_down, *fmt = ctx.saved_tensors
        fmt = _Format(*fmt)
        chunk, s = ctx.chunk, ctx.settings
        num_tokens, d_model = x.shape
        d_ff = w_gate.shape[0]
        dev, dtype = x.device, x.dtype
        grad_y = torch.zeros_like(x) if grad_y is None else grad_y.contiguous()
        l1_scale = torch.zeros(1, dtype=torch.float32, device=dev)
        if grad_l1 is not None:
            l1_scale += grad_l1.float() / num_tokens
        w_down_t = w_down.t().contiguous()
        fb_s, fb_d = _fallback_blocks(d_model)
        dx = _values(x.shape, dtype, dev, s)
        rows_max = min(chunk, num_tokens)
        # zeroed once; after each chunk _clear_kernel zeroes only what the chunk wrote
        h_buf = torch.zeros(rows_max, d_ff, dtype=dtype, device=dev)
        dhug_buf = torch.zeros(rows_max, 2 * d_ff, dtype=dtype, device=dev)
        blocks = triton.cdiv(rows_max, s.block_m)
        ucnt = torch.empty(blocks, dtype=torch.int32, device=dev)
        ucols = torch.empty(blocks, d_ff, dtype=torch.int32, device=dev)
        wpos = torch.empty(rows_max, fmt.words.shape[1], dtype=torch.int32, device=dev)
        dhu_buf, dhg_buf = (_values((rows_max, d_ff), dtype, dev, s) for _ in range(2))  # at the union positions
        single = rows_max >= num_tokens
        acc_dtype = dtype if single else torch.float32
        dw_ug = torch.zeros(2 * d_ff, d_model, dtype=acc_dtype, device=dev)
        dwd = torch.zeros(d_model, d_ff, dtype=acc_dtype, device=dev)
        width, bk_width = fmt.ell_idx.shape[1], fmt.bk_idx.shape[1]
        for row0 in range(0, num_tokens, chunk):
            rows = min(chunk, num_tokens - row0)
            h_c, dhug_c = h_buf[:rows], dhug_buf[:rows]
            x_c, dy_c = x[row0:row0 + rows], grad_y[row0:row0 + rows]
            _union_backward(grad_y, w_gate, w_up, w_down_t, fmt, wpos, row0, l1_scale, ucnt, ucols, h_c, dhug_c,
                            dhu_buf, dhg_buf, dx, s)
            _fallback_bwd_kernel[(triton.cdiv(rows, s.fallback_rows),)](
                x, grad_y, w_gate, w_up, w_down_t, fmt.slot, l1_scale, h_c, dhug_c, dx, row0, rows, d_model, d_ff,
                ROWS=s.fallback_rows, BLOCK_S=fb_s, BLOCK_D=fb_d, num_warps=8)
            if single:
                torch.mm(dhug_c.t(), x_c, out=dw_ug)
                torch.mm(dy_c.t(), h_c, out=dwd)
            else:
                _mm_into_fp32(dw_ug, dhug_c.t(), x_c)
                _mm_into_fp32(dwd, dy_c.t(), h_c)
            if row0 + rows < num_tokens:
                _clear_kernel[(rows,)](fmt.count, fmt.slot, fmt.ell_idx, fmt.bk_idx, h_c, dhug_c, row0, d_ff, width,
                                       bk_width, BLOCK=64)
        dwu, dwg = dw_ug[:d_ff], dw_ug[d_ff:]
        return dx, dwg.to(dtype), dwu.to(dtype), dwd.to(dtype), None, None, None, None


def relu_gated_ffn_triton(x, w_gate, w_up, w_down, *, ell_width=None, backup_rows=None, chunk_rows=None,
                          settings=None):
    """The sparse path (inputs validated by relu_gated_ffn): same outputs as relu_gated_ffn_torch."""
    num_tokens, _ = x.shape
    d_ff = w_gate.shape[0]
    width = min(DEFAULT_ELL_WIDTH if ell_width is None else ell_width, d_ff)
    cap = -(-num_tokens // 8) if backup_rows is None else backup_rows
    chunk = _default_chunk_rows(num_tokens, d_ff) if chunk_rows is None else chunk_rows
    settings = TwellSettings() if settings is None else settings
    x, w_gate, w_up, w_down = (t.contiguous() for t in (x, w_gate, w_up, w_down))
    y, l1, nnz, active, over, fallback = _TwellFFNFunction.apply(x, w_gate, w_up, w_down, width, cap, chunk,
                                                                 settings)
    return y, l1, FFNStats(nnz=nnz, active=active, overflow_rows=over, fallback_rows=fallback)
