"""Causal attention of a chunk of queries over keys and values kept in a pool of pages.

The chunk-recurrent engine (student/long_context.py) keeps each layer's keys and values (after
RoPE) in pages: one page is P consecutive positions of one sequence, all kv heads. A table lists,
per batch row, the slots of N consecutive pages starting at page ``first_page``; the engine calls
these functions once per page set (the pages resident on the GPU, an offload window) and merges:

- ``page_attention_forward`` -> (out, lse) of the attention over one page set's visible keys;
- ``merge_partials`` -> the exact (out, lse) over the union of disjoint page sets;
- ``page_attention_backward`` -> dq of one page set, and its dk, dv ADDED in place into fp32
  gradient pools (one program owns a (slot, kv head) block: no atomics, deterministic), given the
  merged lse and delta = rowsum(dout * out) of the whole attention, so page sets' dq sum to the
  whole's and each page's gradient is exact.

Shapes: q [B, H, Tq, D]; k_pool, v_pool [S, Hkv, P, D] in q's dtype (fp32, bf16, fp16); table
int32 [B, N]; query t of every row sits at position q_start + t and sees key position p iff
p <= q_start + t. Query head h reads kv head h // (H // Hkv) (GQA). Keys past the sequence's end
are never visible to a real query, so the last page may hold anything there (NaN included).

Paths: "torch" (kernels/page_attention_torch.py, explicit fp32 math, the reference and the CPU
path) and "triton" (kernels/page_attention_triton.py: online softmax over the table's pages; a dK/dV
and a dQ kernel for the backward); "auto" picks Triton for CUDA tensors. No autograd Function: the
engine calls forward and backward per page set itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from kernels.multi_tensor import is_power_of_two, triton_can_run
from kernels.page_attention_torch import backward_torch, forward_torch, merge_partials_torch

try:
    from kernels import page_attention_triton as _triton_path
except ImportError:  # no Triton: the torch path needs none
    _triton_path = None

__all__ = ["PageAttentionSettings", "merge_partials", "page_attention_backward", "page_attention_forward"]

IMPLS = ("auto", "torch", "triton")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TRITON_HEAD_DIM = 128  # one [block, D] tile of q, k, v each in registers / shared memory


@dataclass(frozen=True)
class PageAttentionSettings:
    """How the Triton kernels run; every setting gives the same results to rounding. Block sizes are
    powers of two (key blocks may be smaller or larger than a page: a key block's rows look up their
    own page in the table). Query blocks count (query, head-of-the-group) rows: the G query heads
    that share a kv head are packed into one block, so each key/value block is loaded once for all
    of them. The field defaults are FlashAttention-2's usual shapes; `for_head_dim` (what a call
    without settings uses) changes those the H200 sweep of bench_page_attention_gpu.py --sweep
    found faster for that head size (results.jsonl rows page_attention_sweep/*@94276e0)."""

    # forward: (query rows, keys) a step, warps, software-pipeline stages
    fwd_block_m: int = 128
    fwd_block_n: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 2
    # backward dQ kernel: one program per query block, looping over key blocks
    dq_block_m: int = 64
    dq_block_n: int = 64
    dq_warps: int = 4
    dq_stages: int = 2
    # backward dK/dV kernel: one program per (key block, kv head), looping over query blocks
    dkv_block_m: int = 64
    dkv_block_n: int = 64
    dkv_warps: int = 4
    dkv_stages: int = 2
    # fp32 inputs: tl.dot's input precision ("ieee" exact fp32; "tf32" faster on tensor cores)
    fp32_precision: str = "ieee"

    @classmethod
    def for_head_dim(cls, head_dim: int) -> "PageAttentionSettings":
        """The measured-best settings for keys of `head_dim` (rows cited in the class docstring):
        D <= 64 runs the forward on 64-row query blocks with 4 warps and the dQ kernel on 128-row
        blocks with 8 warps; larger D keeps 128-row forward blocks on 4 warps."""
        if head_dim <= 64:
            return cls(fwd_block_m=64, fwd_warps=4, dq_block_m=128, dq_warps=8)
        return cls(fwd_warps=4)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "fp32_precision":
                if value not in ("ieee", "tf32"):
                    raise ValueError(f"fp32_precision must be 'ieee' or 'tf32', got {value!r}")
            elif f.name.endswith(("_warps",)):
                if value not in (1, 2, 4, 8, 16):
                    raise ValueError(f"{f.name} must be 1, 2, 4, 8 or 16, got {value!r}")
            elif f.name.endswith("_stages"):
                if not (isinstance(value, int) and 1 <= value <= 8):
                    raise ValueError(f"{f.name} must be an int in [1, 8], got {value!r}")
            elif not (is_power_of_two(value) and value >= 16):
                raise ValueError(f"{f.name} must be a power of two >= 16 (tl.dot's least), got {value!r}")


def page_attention_forward(q, k_pool, v_pool, table, *, first_page: int, q_start: int, scale: float | None = None,
                           impl: str = "auto", settings: PageAttentionSettings | None = None):
    """(out fp32 [B, H, Tq, D], lse fp32 [B, H, Tq]) of q's causal attention over the visible keys of
    the table's pages only (natural-log lse of scale * q.k; a query that sees none: lse = -inf, out = 0).

    q [B, H, Tq, D]; k_pool, v_pool [S, Hkv, P, D] in q's dtype; table int32 [B, N] of slots in
    [0, S) (not checked on a GPU: out-of-range slots read outside the pool); first_page: the page
    index of table[:, 0]; q_start: the position of query 0. scale: None for 1/sqrt(D).
    impl: "auto" | "torch" | "triton"; settings: the Triton kernels' (None: the defaults)."""
    scale = _checked(q, k_pool, v_pool, table, first_page, q_start, scale)
    if _use_triton(impl, q, k_pool):
        return _triton_path.forward_triton(q, k_pool, v_pool, table.to(torch.int32), first_page, q_start, scale,
                                           settings or PageAttentionSettings.for_head_dim(q.shape[-1]))
    return forward_torch(q, k_pool, v_pool, table, first_page, q_start, scale)


def page_attention_backward(q, dout, lse, delta, k_pool, v_pool, dk_pool, dv_pool, table, *, first_page: int,
                            q_start: int, scale: float | None = None, impl: str = "auto",
                            settings: PageAttentionSettings | None = None) -> torch.Tensor:
    """dq fp32 [B, H, Tq, D] from this page set's keys; ADDS this set's key and value gradients into
    dk_pool, dv_pool (fp32 [S, Hkv, P, D]) at the table's slots, in place, deterministically.

    dout [B, H, Tq, D] in q's dtype; lse, delta fp32 [B, H, Tq] of the WHOLE attention (all page sets
    merged): delta = (dout.float() * out_merged).sum(-1). Distinct table entries must hold distinct
    slots (not checked). Other arguments as in page_attention_forward."""
    scale = _checked(q, k_pool, v_pool, table, first_page, q_start, scale)
    _check_backward(q, dout, lse, delta, k_pool, dk_pool, dv_pool)
    if _use_triton(impl, q, k_pool):
        return _triton_path.backward_triton(q, dout, lse, delta, k_pool, v_pool, dk_pool, dv_pool,
                                            table.to(torch.int32), first_page, q_start, scale,
                                            settings or PageAttentionSettings.for_head_dim(q.shape[-1]))
    return backward_torch(q, dout, lse, delta, k_pool, v_pool, dk_pool, dv_pool, table, first_page, q_start, scale)


def merge_partials(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact (out, lse) of the attention over the union of disjoint page sets from each set's
    (out fp32 [B, H, Tq, D], lse fp32 [B, H, Tq]); sets a query sees nothing of (lse -inf) weigh 0."""
    parts = list(parts)
    if not parts:
        raise ValueError("merge_partials needs at least one (out, lse) pair, got none")
    shape = parts[0][0].shape
    for out, lse in parts:
        if out.shape != shape or lse.shape != shape[:-1]:
            raise ValueError(f"merge_partials: every out must be {tuple(shape)} and lse {tuple(shape[:-1])}, "
                             f"got {tuple(out.shape)} and {tuple(lse.shape)}")
        if out.dtype != torch.float32 or lse.dtype != torch.float32:
            raise ValueError(f"merge_partials takes fp32 out and lse, got {out.dtype} and {lse.dtype}")
    if len(parts) == 1:
        return parts[0]
    return merge_partials_torch(parts)


def _use_triton(impl: str, q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "auto" and not (_triton_path is not None and q.is_cuda):
        return False
    if not (_triton_path is not None and triton_can_run(q.device)):
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import) and the "
                         f"triton package, got a tensor on {q.device}; use impl='auto' or 'torch'")
    P, D = k_pool.shape[2], k_pool.shape[3]
    if not (is_power_of_two(P) and P >= 16):
        raise ValueError(f"impl='triton' needs a page size that is a power of two >= 16, got {P}; "
                         f"pick another --page-tokens or use impl='torch'")
    if D > MAX_TRITON_HEAD_DIM:
        raise ValueError(f"impl='triton' takes head dims up to {MAX_TRITON_HEAD_DIM}, got {D}; use impl='torch'")
    return True


def _checked(q, k_pool, v_pool, table, first_page, q_start, scale) -> float:
    """Validates the shared arguments; returns the scale to use."""
    if q.dim() != 4 or k_pool.dim() != 4:
        raise ValueError(f"q must be [B, H, Tq, D] and k_pool [S, Hkv, P, D], got {tuple(q.shape)} and "
                         f"{tuple(k_pool.shape)}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool must match k_pool's shape {tuple(k_pool.shape)}, got {tuple(v_pool.shape)}")
    if q.dtype not in _DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"q, k_pool, v_pool must share one of fp32/bf16/fp16, got {q.dtype}, {k_pool.dtype}, "
                         f"{v_pool.dtype}")
    B, H, _, D = q.shape
    Hkv = k_pool.shape[1]
    if k_pool.shape[3] != D:
        raise ValueError(f"k_pool's head dim must be q's {D}, got {k_pool.shape[3]}")
    if H % Hkv:
        raise ValueError(f"the query heads ({H}) must be a multiple of the kv heads ({Hkv})")
    if table.dim() != 2 or table.shape[0] != B or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"table must be int32 [B={B}, N], got {table.dtype} {tuple(table.shape)}")
    if len({q.device, k_pool.device, v_pool.device, table.device}) != 1:
        raise ValueError(f"q, k_pool, v_pool and table must be on one device, got {q.device}, {k_pool.device}, "
                         f"{v_pool.device}, {table.device}")
    if table.device.type == "cpu" and table.numel() and not (0 <= int(table.min()) and
                                                             int(table.max()) < k_pool.shape[0]):
        raise ValueError(f"table slots must be in [0, {k_pool.shape[0]}), got [{int(table.min())}, "
                         f"{int(table.max())}]")
    for name, value in (("first_page", first_page), ("q_start", q_start)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if scale is None:
        return 1.0 / math.sqrt(D)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0 or None (1/sqrt(D)), got {scale!r}")
    return float(scale)


def _check_backward(q, dout, lse, delta, k_pool, dk_pool, dv_pool) -> None:
    if dout.shape != q.shape or dout.dtype != q.dtype or dout.device != q.device:
        raise ValueError(f"dout must match q ({q.dtype} {tuple(q.shape)}), got {dout.dtype} {tuple(dout.shape)}")
    for name, t in (("lse", lse), ("delta", delta)):
        if t.shape != q.shape[:3] or t.dtype != torch.float32 or t.device != q.device:
            raise ValueError(f"{name} must be fp32 {tuple(q.shape[:3])}, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("dk_pool", dk_pool), ("dv_pool", dv_pool)):
        if t.shape != k_pool.shape or t.dtype != torch.float32 or t.device != k_pool.device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 {tuple(k_pool.shape)} on {k_pool.device} (it is "
                             f"updated in place), got {t.dtype} {tuple(t.shape)} on {t.device}")
