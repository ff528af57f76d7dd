"""Causal attention of a chunk of queries over keys and values kept in a pool of pages.

The chunk-recurrent engine (student/long_context/) keeps each layer's keys and values (after
RoPE) in pages: one page is P consecutive positions of one sequence, all kv heads. A table lists,
per batch row, the slots of N consecutive pages starting at page ``first_page``; the engine calls
these functions once per page set (the pages resident on the GPU, an offload window, the pages a
sparse chunk selected) and merges:

- ``page_attention_forward`` -> (out, lse) of the attention over one page set's visible keys;
- ``merge_partials`` -> the exact (out, lse) over the union of disjoint page sets;
- ``page_attention_backward`` -> dq of one page set, and its dk, dv ADDED into fp32 gradient
  pools at the table's slots, given the merged out and lse of the whole attention, so page sets'
  dq sum to the whole's and each page's gradient is exact.

Shapes: q [B, H, Tq, D]; k_pool, v_pool [S, Hkv, P, D] in q's dtype (fp32, bf16, fp16); table
int32 [B, N]; query t of every row sits at position q_start + t and sees key position p iff
p <= q_start + t. Query head h reads kv head h // (H // Hkv) (GQA). Keys past the sequence's end
are never visible to a real query, so the last page may hold anything there (NaN included).

Paths: "cudnn", bf16/fp16 CUDA tensors: the set's pages are gathered into contiguous keys (a copy
of Tk x D per kv head, small beside the Tq x Tk x D of attention) and cuDNN's fused attention
(aten's `_scaled_dot_product_cudnn_attention` and its backward, which take grouped kv heads and
return the lse) runs on at most three pieces a set: the keys before the chunk (every query sees
them), the chunk's own keys (a causal square) and, when a set ends inside the chunk, the queries
past it. Its backward is given the merged out and lse, so each piece's gradients are its exact
share. "torch" (kernels/page_attention_torch.py): explicit fp32 math, the reference, the CPU path
and fp32's. "auto" picks cudnn where it applies. An own Triton kernel (forward and a
deterministic two-kernel backward) lived here until cuDNN's was measured faster at every case of
bench_page_attention_gpu.py (RESULTS.md, "Page attention"); git history has it.
No autograd Function: the engine calls forward and backward per page set itself.
"""

from __future__ import annotations

import math

import torch

from kernels.page_attention_torch import (
    backward_torch,
    forward_torch,
    gather_pages,
    merge_partials_torch,
)

__all__ = ["merge_partials", "page_attention_backward", "page_attention_forward"]

IMPLS = ("auto", "torch", "cudnn")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def page_attention_forward(q, k_pool, v_pool, table, *, first_page: int, q_start: int, scale: float | None = None,
                           impl: str = "auto"):
    """(out fp32 [B, H, Tq, D], lse fp32 [B, H, Tq]) of q's causal attention over the visible keys of
    the table's pages only (natural-log lse of scale * q.k; a query that sees none: lse = -inf, out = 0).

    q [B, H, Tq, D]; k_pool, v_pool [S, Hkv, P, D] in q's dtype; table int32 [B, N] of slots in
    [0, S) (not checked on a GPU); first_page: the page index of table[:, 0]; q_start: the
    position of query 0. scale: None for 1/sqrt(D). impl: "auto" | "torch" | "cudnn"."""
    scale = _checked(q, k_pool, v_pool, table, first_page, q_start, scale)
    if not _use_cudnn(impl, q):
        return forward_torch(q, k_pool, v_pool, table, first_page, q_start, scale)
    B, H, Tq, D = q.shape
    k, v = gather_pages(k_pool, table), gather_pages(v_pool, table)
    out = torch.zeros(B, H, Tq, D, device=q.device, dtype=torch.float32)
    lse = torch.full((B, H, Tq), float("-inf"), device=q.device)
    for t0, t1, k0, k1, causal in _pieces(Tq, first_page * k_pool.shape[2], k.shape[2], q_start):
        o, l_ = _cudnn_forward(q[:, :, t0:t1], k[:, :, k0:k1], v[:, :, k0:k1], causal, scale)
        both = merge_partials_torch([(out[:, :, t0:t1], lse[:, :, t0:t1]), (o.float(), l_.view(B, H, t1 - t0))])
        out[:, :, t0:t1], lse[:, :, t0:t1] = both
    return out, lse


def page_attention_backward(q, dout, out, lse, k_pool, v_pool, dk_pool, dv_pool, table, *, first_page: int,
                            q_start: int, scale: float | None = None, impl: str = "auto") -> torch.Tensor:
    """dq fp32 [B, H, Tq, D] from this page set's keys; ADDS this set's key and value gradients into
    dk_pool, dv_pool (fp32 [S, Hkv, P, D]) at the table's slots, in place.

    dout [B, H, Tq, D] in q's dtype; out [B, H, Tq, D] (any float dtype) and lse fp32 [B, H, Tq]
    of the WHOLE attention (all page sets merged). Distinct table entries must hold distinct slots
    (not checked). Other arguments as in page_attention_forward."""
    scale = _checked(q, k_pool, v_pool, table, first_page, q_start, scale)
    _check_backward(q, dout, out, lse, k_pool, dk_pool, dv_pool)
    if not _use_cudnn(impl, q):
        delta = (dout.float() * out.float()).sum(-1)
        return backward_torch(q, dout, lse, delta, k_pool, v_pool, dk_pool, dv_pool, table, first_page, q_start,
                              scale)
    B, H, Tq, D = q.shape
    k, v = gather_pages(k_pool, table), gather_pages(v_pool, table)
    out = out.to(q.dtype)
    dq = torch.zeros(B, H, Tq, D, device=q.device, dtype=torch.float32)
    dk = torch.zeros(k.shape, device=q.device, dtype=torch.float32)
    dv = torch.zeros(k.shape, device=q.device, dtype=torch.float32)
    for t0, t1, k0, k1, causal in _pieces(Tq, first_page * k_pool.shape[2], k.shape[2], q_start):
        grads = _cudnn_backward(dout[:, :, t0:t1], q[:, :, t0:t1], k[:, :, k0:k1], v[:, :, k0:k1], out[:, :, t0:t1],
                                lse[:, :, t0:t1], causal, scale)
        dq[:, :, t0:t1] += grads[0]
        dk[:, :, k0:k1] += grads[1]
        dv[:, :, k0:k1] += grads[2]
    _add_pages(dk_pool, dk, table)
    _add_pages(dv_pool, dv, table)
    return dq


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


def _pieces(Tq: int, first_pos: int, num_keys: int, q_start: int) -> list[tuple[int, int, int, int, bool]]:
    """(t0, t1, k0, k1, causal): queries t0..t1 of the chunk against keys k0..k1 of a set whose key
    j sits at position first_pos + j, such that the pieces cover exactly the visible pairs (query t
    sees position p iff p <= q_start + t): keys before the chunk, seen by every query; the chunk's
    own keys in the set, a causal square from the query at their first position; and the queries
    past the set's end, which see all of those."""
    pieces = []
    past = min(first_pos + num_keys, q_start) - first_pos
    if past > 0:
        pieces.append((0, Tq, 0, past, False))
    a, b = max(first_pos, q_start), min(first_pos + num_keys, q_start + Tq)
    if b > a:
        t0, n = a - q_start, b - a
        pieces.append((t0, t0 + n, a - first_pos, b - first_pos, True))
        if t0 + n < Tq:
            pieces.append((t0 + n, Tq, a - first_pos, b - first_pos, False))
    return pieces


def _add_pages(pool, grad, table) -> None:
    """pool[table slots] += grad [B, Hkv, N*P, D] laid back into pages (distinct slots: each once)."""
    B, N = table.shape
    _, Hkv, P, D = pool.shape
    pages = grad.view(B, Hkv, N, P, D).transpose(1, 2).reshape(B * N, Hkv, P, D)
    slots = table.reshape(-1).long()
    pool[slots] += pages


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    if q.shape[2] == 1 and k.shape[2] == 1:
        return _lone_forward(q, k, v, scale)
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return r[0], r[1]


def _cudnn_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    if q.shape[2] == 1 and k.shape[2] == 1:
        return _lone_backward(dout, q, k, v, out, lse, scale)
    B, H, T, _ = q.shape
    no_rng = torch.empty(0, device=q.device)  # philox seed and offset: no dropout
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.reshape(B, H, T, 1), no_rng, no_rng, None, None, None, T, k.shape[2], 0.0, causal,
        scale=scale)
    return dq.float(), dk.float(), dv.float()


# A piece of one query and one key (a chunk's last query alone at the first position of a page
# set, or a chunk of one token) is one cuDNN refuses ("s_q = s_kv = 1 is not supported"): its
# attention is that key's value, with weight exp(s - lse) in the backward, in plain torch.
def _lone_forward(q, k, v, scale: float):
    """(out [B, H, 1, D], lse [B, H, 1, 1]) of each query head against its group's one key."""
    groups = q.shape[1] // k.shape[1]
    k_h = k.float().repeat_interleave(groups, dim=1)
    lse = scale * (q.float() * k_h).sum(-1, keepdim=True)
    return v.float().repeat_interleave(groups, dim=1), lse


def _lone_backward(dout, q, k, v, out, lse, scale: float):
    """(dq, dk, dv) fp32 of one query against one key, with out and lse of the whole attention."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    groups = H // Hkv
    dout, q, out = dout.float(), q.float(), out.float()
    k_h, v_h = k.float().repeat_interleave(groups, dim=1), v.float().repeat_interleave(groups, dim=1)
    p = torch.exp(scale * (q * k_h).sum(-1, keepdim=True) - lse.reshape(B, H, 1, 1))
    ds = p * ((dout * v_h).sum(-1, keepdim=True) - (dout * out).sum(-1, keepdim=True))
    per_group = (B, Hkv, groups, 1, D)
    return scale * ds * k_h, (scale * ds * q).view(per_group).sum(2), (p * dout).view(per_group).sum(2)


def _use_cudnn(impl: str, q: torch.Tensor) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    fits = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and torch.backends.cudnn.is_available()
    if impl == "cudnn" and not fits:
        raise ValueError(f"impl='cudnn' needs bf16/fp16 CUDA tensors and cuDNN, got {q.dtype} on {q.device}; "
                         f"use impl='auto' or 'torch'")
    return impl != "torch" and fits


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


def _check_backward(q, dout, out, lse, k_pool, dk_pool, dv_pool) -> None:
    if dout.shape != q.shape or dout.dtype != q.dtype or dout.device != q.device:
        raise ValueError(f"dout must match q ({q.dtype} {tuple(q.shape)}), got {dout.dtype} {tuple(dout.shape)}")
    if out.shape != q.shape or not out.is_floating_point() or out.device != q.device:
        raise ValueError(f"out must be a float {tuple(q.shape)} on {q.device}, got {out.dtype} {tuple(out.shape)}")
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be fp32 {tuple(q.shape[:3])}, got {lse.dtype} {tuple(lse.shape)}")
    for name, t in (("dk_pool", dk_pool), ("dv_pool", dv_pool)):
        if t.shape != k_pool.shape or t.dtype != torch.float32 or t.device != k_pool.device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 {tuple(k_pool.shape)} on {k_pool.device} (it is "
                             f"updated in place), got {t.dtype} {tuple(t.shape)} on {t.device}")
