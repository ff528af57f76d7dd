"""Page attention in plain torch: the reference the cuDNN path is tested against, and the CPU path.

Layout (kernels/page_attention.py has the full contract): k_pool, v_pool [S, Hkv, P, D]; table
[B, N] holds the slot of the page of positions (first_page + j) * P + [0, P) of row b; query t sits
at position q_start + t and sees key position p iff p <= q_start + t. Query head h reads kv head
h // G with G = H // Hkv.

The math, per row and head, over the keys K, V this table makes visible (s = scale * q.k):
    forward:  lse = logsumexp(s), out = softmax(s) V       (no visible key: lse = -inf, out = 0)
    backward: p = exp(s - lse_all), dp = dout V^T, ds = p (dp - delta),
              dq = scale ds K, dk = scale ds^T q, dv = p^T dout
with lse_all and delta = rowsum(dout * out_all) of the whole attention, so every page set's p is
its share of the whole softmax and the gradients of disjoint page sets add up to the whole's.

Everything runs in fp32 over gathered [B, Hkv, G, Tq, N*P] scores: memory grows with Tq x N*P,
which is what a reference on small CPU inputs can afford.
"""

from __future__ import annotations

import torch


def gather_pages(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """pool [S, Hkv, P, D], table [B, N] -> [B, Hkv, N*P, D] in the pool's dtype, the table's pages in order."""
    pages = pool[table.long()]  # [B, N, Hkv, P, D]
    B, N, Hkv, P, D = pages.shape
    return pages.permute(0, 2, 1, 3, 4).reshape(B, Hkv, N * P, D)


def _visible(table, P: int, first_page: int, q_start: int, Tq: int, device) -> torch.Tensor:
    """bool [Tq, N*P]: query t sees key k of the table's pages."""
    key_pos = first_page * P + torch.arange(table.shape[1] * P, device=device)
    query_pos = q_start + torch.arange(Tq, device=device)
    return key_pos[None, :] <= query_pos[:, None]


def _grouped(x: torch.Tensor, Hkv: int) -> torch.Tensor:
    """[B, H, Tq, D] -> fp32 [B, Hkv, G, Tq, D]."""
    B, H, Tq, D = x.shape
    return x.float().reshape(B, Hkv, H // Hkv, Tq, D)


def _keys_values(k_pool, v_pool, table, visible):
    """Gathered K, V with keys no query sees set to 0: the last page past the sequence's end may
    hold anything (NaN included), and 0 * NaN would reach the outputs through p @ V."""
    seen = visible.any(0)[None, None, :, None]
    zero = torch.zeros((), device=k_pool.device)
    return (torch.where(seen, gather_pages(k_pool, table).float(), zero),
            torch.where(seen, gather_pages(v_pool, table).float(), zero))


def forward_torch(q, k_pool, v_pool, table, first_page: int, q_start: int, scale: float):
    """out fp32 [B, H, Tq, D], lse fp32 [B, H, Tq] (arguments as in page_attention_forward)."""
    B, H, Tq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    visible = _visible(table, P, first_page, q_start, Tq, q.device)
    k, v = _keys_values(k_pool, v_pool, table, visible)
    s = scale * torch.einsum("bhgtd,bhkd->bhgtk", _grouped(q, Hkv), k)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf where a query sees no key
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # exp(-inf) = 0 there
    out = torch.einsum("bhgtk,bhkd->bhgtd", p, v)
    return out.reshape(B, H, Tq, D), lse.reshape(B, H, Tq)


def backward_torch(q, dout, lse, delta, k_pool, v_pool, dk_pool, dv_pool, table, first_page: int, q_start: int,
                   scale: float) -> torch.Tensor:
    """Adds this page set's dk, dv into dk_pool, dv_pool (slots of the table) and returns its dq."""
    B, H, Tq, D = q.shape
    Hkv, P = k_pool.shape[1], k_pool.shape[2]
    visible = _visible(table, P, first_page, q_start, Tq, q.device)
    k, v = _keys_values(k_pool, v_pool, table, visible)
    q_g, dout_g = _grouped(q, Hkv), _grouped(dout, Hkv)
    lse_g = lse.reshape(B, Hkv, H // Hkv, Tq, 1)
    delta_g = delta.reshape(B, Hkv, H // Hkv, Tq, 1)
    s = scale * torch.einsum("bhgtd,bhkd->bhgtk", q_g, k)
    # a query that sees no key at all has lse = -inf; its p is 0 (its s are masked to -inf too)
    p = torch.exp(s.masked_fill(~visible, float("-inf")) - torch.where(torch.isinf(lse_g), 0.0, lse_g))
    dp = torch.einsum("bhgtd,bhkd->bhgtk", dout_g, v)
    ds = p * (dp - delta_g)
    dq = scale * torch.einsum("bhgtk,bhkd->bhgtd", ds, k)
    dk = scale * torch.einsum("bhgtk,bhgtd->bhkd", ds, q_g)  # summed over the group's query heads
    dv = torch.einsum("bhgtk,bhgtd->bhkd", p, dout_g)
    slots = table.long().reshape(-1)  # distinct (the caller guarantees it), so index_add_ adds each once
    for grad, pool in ((dk, dk_pool), (dv, dv_pool)):
        pages = grad.reshape(B, Hkv, -1, P, D).permute(0, 2, 1, 3, 4).reshape(-1, Hkv, P, D)
        pool.index_add_(0, slots, pages)
    return dq.reshape(B, H, Tq, D)


def merge_partials_torch(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """The (out, lse) of the union of disjoint page sets from each set's (out, lse)."""
    lse_all = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    lse_safe = torch.where(torch.isinf(lse_all), 0.0, lse_all)
    out = torch.zeros_like(parts[0][0])
    for part_out, part_lse in parts:
        out += torch.exp(part_lse - lse_safe)[..., None] * part_out  # a -inf part weighs exp(-inf) = 0
    return out, lse_all
