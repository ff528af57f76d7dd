"""Page attention's Triton kernels and their launchers (the API and the contract: kernels/page_attention.py).

Rows and keys. A program's query block is BLOCK_M rows of the flattened (query t, group head g)
index t * G + g of one (batch row, kv head): the G query heads that read one kv head share every
key/value load, and consecutive rows span BLOCK_M / G query positions, so the causal bounds stay
tight. A key block is BLOCK_N consecutive keys of the table, key k at position first_key + k; each
row looks its page (k // P) up in the table, so key blocks may be smaller or larger than a page.

Masks. Only blocks where a query and a key block overlap causally, or a block runs past the table
or past the last query, take the masked loop; the others skip the comparisons. Keys past the last
query are loaded as 0 (the last page may hold anything there, NaN included: p = 0 alone would not
keep 0 * NaN out of p @ V). Scores are kept in log2 units (qk_scale = scale * log2(e)) for exp2.

Backward (FlashAttention-2's split): a dK/dV program owns one (key block, batch row, kv head), loops
over the query blocks that see it and ADDS its sums into dk_pool, dv_pool with a plain read-add-write
(no other program touches those rows: table entries hold distinct slots), and a dQ program owns a
query block and loops over key blocks. Both recompute p from the merged lse and use the merged delta.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b with fp32 sums. PRECISION: "ieee" / "tf32" for fp32 inputs, "default" for bf16 / fp16, or
    "upcast": bf16 / fp16 inputs multiplied as fp32 (the same products and sums), for Triton's CPU
    interpreter, whose tl.dot reads bf16 inputs wrongly (kernels/twell_ffn_triton.py says so too:
    checked again with triton 3.9, errors of 1e10 on a 16 x 16 product)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif PRECISION == "default":
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _rows(pid_m, Tq, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """The block's flattened rows: (query index t, head in the group g, row in range)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows // G, rows % G, rows < Tq * G


@triton.jit
def _load_rows(ptr, b, hkv, t, g, row_ok, d, d_ok, stride_b, stride_h, stride_t, G: tl.constexpr):
    """[BLOCK_M, BLOCK_D] rows of a [B, H, Tq, D] tensor (unit stride along D), 0 outside."""
    offs = b * stride_b + (hkv * G + g)[:, None] * stride_h + t[:, None] * stride_t + d[None, :]
    return tl.load(ptr + offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _key_offsets(TABLE, b, hkv, kidx, num_keys, d, stride_tb, stride_s, stride_h, stride_p, P: tl.constexpr):
    """Element offsets [BLOCK_N, BLOCK_D] of keys kidx of the table into a [S, Hkv, P, D] pool."""
    slot = tl.load(TABLE + b * stride_tb + kidx // P, mask=kidx < num_keys, other=0).to(tl.int64)
    return slot[:, None] * stride_s + hkv * stride_h + (kidx % P)[:, None] * stride_p + d[None, :]


@triton.jit
def _key_block(q, K, V, TABLE, b, hkv, kb, num_keys, q_pos, hi_pos, first_key, d, d_ok, qk_scale,
               stride_tb, stride_s, stride_h, stride_p,
               P: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr):
    """Key block kb's keys and values [BLOCK_N, BLOCK_D] and the rows' scaled scores [BLOCK_M,
    BLOCK_N]; with MASK, keys past the table or the block's last query load as 0 and scores a row
    may not see are -inf (a block wholly visible to every row skips both)."""
    kidx = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = _key_offsets(TABLE, b, hkv, kidx, num_keys, d, stride_tb, stride_s, stride_h, stride_p, P)
    if MASK:
        key_ok = (kidx < num_keys) & (first_key + kidx <= hi_pos)
        k = tl.load(K + offs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + offs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        k = tl.load(K + offs, mask=d_ok[None, :], other=0.0)
        v = tl.load(V + offs, mask=d_ok[None, :], other=0.0)
    s = _dot(q, tl.trans(k), PRECISION) * qk_scale
    if MASK:
        visible = (first_key + kidx)[None, :] <= q_pos[:, None]
        s = tl.where(visible & (kidx < num_keys)[None, :], s, float("-inf"))
    return k, v, s


@triton.jit
def _fwd_step(acc, m_i, l_i, q, K, V, TABLE, b, hkv, kb, num_keys, q_pos, hi_pos, first_key, d, d_ok, qk_scale,
              stride_tb, stride_s, stride_h, stride_p,
              P: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr):
    k, v, s = _key_block(q, K, V, TABLE, b, hkv, kb, num_keys, q_pos, hi_pos, first_key, d, d_ok, qk_scale,
                         stride_tb, stride_s, stride_h, stride_p, P, BLOCK_N, MASK, PRECISION)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: exp2(-inf) = 0
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fwd_kernel(Q, K, V, TABLE, OUT, LSE,
                stride_qb, stride_qh, stride_qt, stride_s, stride_h, stride_p, stride_tb,
                stride_ob, stride_oh, stride_ot, stride_lb, stride_lh,
                Tq, N, Hkv, first_key, q_start, qk_scale,
                G: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1) // Hkv
    hkv = tl.program_id(1) % Hkv
    t, g, row_ok = _rows(pid_m, Tq, G, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = _load_rows(Q, b, hkv, t, g, row_ok, d, d_ok, stride_qb, stride_qh, stride_qt, G)
    q_pos = q_start + t
    lo_pos = q_start + (pid_m * BLOCK_M) // G
    hi_pos = q_start + (tl.minimum(pid_m * BLOCK_M + BLOCK_M, Tq * G) - 1) // G
    num_keys = N * P
    # keys any row of the block sees: [0, end); keys every row sees and inside the table: full blocks
    end = tl.maximum(tl.minimum(num_keys, hi_pos - first_key + 1), 0)
    full_blocks = tl.maximum(tl.minimum(num_keys, lo_pos - first_key + 1), 0) // BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for kb in range(0, full_blocks):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, K, V, TABLE, b, hkv, kb, num_keys, q_pos, hi_pos, first_key, d,
                                  d_ok, qk_scale, stride_tb, stride_s, stride_h, stride_p, P, BLOCK_N, False,
                                  PRECISION)
    for kb in range(full_blocks, tl.cdiv(end, BLOCK_N)):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, K, V, TABLE, b, hkv, kb, num_keys, q_pos, hi_pos, first_key, d,
                                  d_ok, qk_scale, stride_tb, stride_s, stride_h, stride_p, P, BLOCK_N, True,
                                  PRECISION)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    h = hkv * G + g
    tl.store(OUT + b * stride_ob + h[:, None] * stride_oh + t[:, None] * stride_ot + d[None, :], out,
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + b * stride_lb + h * stride_lh + t, lse, mask=row_ok)


@triton.jit
def _dq_step(dq, q, do, lse2, delta, K, V, TABLE, b, hkv, kb, num_keys, q_pos, hi_pos, first_key, d, d_ok,
             qk_scale, stride_tb, stride_s, stride_h, stride_p,
             P: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr):
    k, v, s = _key_block(q, K, V, TABLE, b, hkv, kb, num_keys, q_pos, hi_pos, first_key, d, d_ok, qk_scale,
                         stride_tb, stride_s, stride_h, stride_p, P, BLOCK_N, MASK, PRECISION)
    p = tl.exp2(s - lse2[:, None])
    dp = _dot(do, tl.trans(v), PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.to(k.dtype), k, PRECISION)


@triton.jit
def _dq_kernel(Q, DO, LSE, DELTA, K, V, TABLE, DQ,
               stride_qb, stride_qh, stride_qt, stride_s, stride_h, stride_p, stride_tb, stride_lb, stride_lh,
               Tq, N, Hkv, first_key, q_start, qk_scale, scale,
               G: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """DQ: fp32 with q's strides (the launcher makes both contiguous); LSE, DELTA share strides."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1) // Hkv
    hkv = tl.program_id(1) % Hkv
    t, g, row_ok = _rows(pid_m, Tq, G, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = _load_rows(Q, b, hkv, t, g, row_ok, d, d_ok, stride_qb, stride_qh, stride_qt, G)
    do = _load_rows(DO, b, hkv, t, g, row_ok, d, d_ok, stride_qb, stride_qh, stride_qt, G)
    h = hkv * G + g
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + t, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # sees no key: p = 0
    delta = tl.load(DELTA + b * stride_lb + h * stride_lh + t, mask=row_ok, other=0.0)
    q_pos = q_start + t
    lo_pos = q_start + (pid_m * BLOCK_M) // G
    hi_pos = q_start + (tl.minimum(pid_m * BLOCK_M + BLOCK_M, Tq * G) - 1) // G
    num_keys = N * P
    end = tl.maximum(tl.minimum(num_keys, hi_pos - first_key + 1), 0)
    full_blocks = tl.maximum(tl.minimum(num_keys, lo_pos - first_key + 1), 0) // BLOCK_N
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for kb in range(0, full_blocks):
        dq = _dq_step(dq, q, do, lse2, delta, K, V, TABLE, b, hkv, kb, num_keys, q_pos, hi_pos, first_key, d, d_ok,
                      qk_scale, stride_tb, stride_s, stride_h, stride_p, P, BLOCK_N, False, PRECISION)
    for kb in range(full_blocks, tl.cdiv(end, BLOCK_N)):
        dq = _dq_step(dq, q, do, lse2, delta, K, V, TABLE, b, hkv, kb, num_keys, q_pos, hi_pos, first_key, d, d_ok,
                      qk_scale, stride_tb, stride_s, stride_h, stride_p, P, BLOCK_N, True, PRECISION)
    tl.store(DQ + b * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :], dq * scale,
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _dkv_step(dk, dv, k, v, Q, DO, LSE, DELTA, b, hkv, pid_m, Tq, q_start, kpos, d, d_ok, qk_scale,
              stride_qb, stride_qh, stride_qt, stride_lb, stride_lh,
              G: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr):
    t, g, row_ok = _rows(pid_m, Tq, G, BLOCK_M)
    q = _load_rows(Q, b, hkv, t, g, row_ok, d, d_ok, stride_qb, stride_qh, stride_qt, G)
    do = _load_rows(DO, b, hkv, t, g, row_ok, d, d_ok, stride_qb, stride_qh, stride_qt, G)
    h = hkv * G + g
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + t, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + b * stride_lb + h * stride_lh + t, mask=row_ok, other=0.0)
    s_t = _dot(k, tl.trans(q), PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
    if MASK:
        visible = (kpos[:, None] <= (q_start + t)[None, :]) & row_ok[None, :]
        s_t = tl.where(visible, s_t, float("-inf"))
    p_t = tl.exp2(s_t - lse2[None, :])
    dv += _dot(p_t.to(do.dtype), do, PRECISION)
    dp_t = _dot(v, tl.trans(do), PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += _dot(ds_t.to(q.dtype), q, PRECISION)
    return dk, dv


@triton.jit
def _dkv_kernel(Q, DO, LSE, DELTA, K, V, TABLE, DK, DV,
                stride_qb, stride_qh, stride_qt, stride_s, stride_h, stride_p, stride_tb, stride_lb, stride_lh,
                stride_gs, stride_gh, stride_gp,
                Tq, N, Hkv, first_key, q_start, qk_scale, scale,
                G: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """DK, DV: the fp32 gradient pools, strides (stride_gs, stride_gh, stride_gp, 1)."""
    kb = tl.program_id(0)
    b = tl.program_id(1) // Hkv
    hkv = tl.program_id(1) % Hkv
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    num_keys = N * P
    rows = Tq * G
    kidx = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    kpos = first_key + kidx
    key_in_table = kidx < num_keys
    offs = _key_offsets(TABLE, b, hkv, kidx, num_keys, d, stride_tb, stride_s, stride_h, stride_p, P)
    kv_mask = (key_in_table & (kpos <= q_start + Tq - 1))[:, None] & d_ok[None, :]
    k = tl.load(K + offs, mask=kv_mask, other=0.0)
    v = tl.load(V + offs, mask=kv_mask, other=0.0)
    kpos_lo = first_key + kb * BLOCK_N
    kpos_hi = kpos_lo + BLOCK_N - 1
    num_mblocks = tl.cdiv(rows, BLOCK_M)
    m_start = tl.minimum(tl.maximum(kpos_lo - q_start, 0) * G, rows) // BLOCK_M
    # from m_full on, every row of a block sees every key of this block (keys past the table are
    # loaded as 0 and their rows are never stored: each row's dk, dv depends on its own key only)
    m_full = tl.minimum(tl.cdiv(tl.maximum(kpos_hi - q_start, 0) * G, BLOCK_M), num_mblocks)
    m_whole = rows // BLOCK_M  # blocks with no row past the end
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for pid_m in range(m_start, m_full):
        dk, dv = _dkv_step(dk, dv, k, v, Q, DO, LSE, DELTA, b, hkv, pid_m, Tq, q_start, kpos, d, d_ok,
                           qk_scale, stride_qb, stride_qh, stride_qt, stride_lb, stride_lh, G, BLOCK_M, True,
                           PRECISION)
    for pid_m in range(m_full, m_whole):
        dk, dv = _dkv_step(dk, dv, k, v, Q, DO, LSE, DELTA, b, hkv, pid_m, Tq, q_start, kpos, d, d_ok,
                           qk_scale, stride_qb, stride_qh, stride_qt, stride_lb, stride_lh, G, BLOCK_M, False,
                           PRECISION)
    for pid_m in range(tl.maximum(m_full, m_whole), num_mblocks):
        dk, dv = _dkv_step(dk, dv, k, v, Q, DO, LSE, DELTA, b, hkv, pid_m, Tq, q_start, kpos, d, d_ok,
                           qk_scale, stride_qb, stride_qh, stride_qt, stride_lb, stride_lh, G, BLOCK_M, True,
                           PRECISION)
    slot = tl.load(TABLE + b * stride_tb + kidx // P, mask=key_in_table, other=0).to(tl.int64)
    goffs = slot[:, None] * stride_gs + hkv * stride_gh + (kidx % P)[:, None] * stride_gp + d[None, :]
    gmask = key_in_table[:, None] & d_ok[None, :]
    tl.store(DK + goffs, tl.load(DK + goffs, mask=gmask, other=0.0) + dk * scale, mask=gmask)
    tl.store(DV + goffs, tl.load(DV + goffs, mask=gmask, other=0.0) + dv, mask=gmask)


def _precision(dtype: torch.dtype, settings):
    """The kernels' PRECISION (see _dot)."""
    if dtype == torch.float32:
        return settings.fp32_precision
    return "upcast" if os.environ.get("TRITON_INTERPRET") == "1" else "default"


def forward_triton(q, k_pool, v_pool, table, first_page: int, q_start: int, scale: float, settings):
    B, H, Tq, D = q.shape
    _, Hkv, P, _ = k_pool.shape
    N = table.shape[1]
    G = H // Hkv
    q, k_pool, v_pool, table = q.contiguous(), k_pool.contiguous(), v_pool.contiguous(), table.contiguous()
    out = torch.empty(B, H, Tq, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H, Tq, device=q.device, dtype=torch.float32)
    if B * H * Tq == 0:
        return out, lse
    grid = (triton.cdiv(Tq * G, settings.fwd_block_m), B * Hkv)
    _fwd_kernel[grid](q, k_pool, v_pool, table, out, lse, *q.stride()[:3], *k_pool.stride()[:3], table.stride(0),
                      *out.stride()[:3], *lse.stride()[:2], Tq, N, Hkv, first_page * P, q_start, scale * LOG2E,
                      G=G, P=P, D=D, BLOCK_D=_block_d(D), BLOCK_M=settings.fwd_block_m,
                      BLOCK_N=settings.fwd_block_n, PRECISION=_precision(q.dtype, settings),
                      num_warps=settings.fwd_warps, num_stages=settings.fwd_stages)
    return out, lse


def backward_triton(q, dout, lse, delta, k_pool, v_pool, dk_pool, dv_pool, table, first_page: int, q_start: int,
                    scale: float, settings):
    B, H, Tq, D = q.shape
    S, Hkv, P, _ = k_pool.shape
    N = table.shape[1]
    G = H // Hkv
    q, dout, k_pool, v_pool, table = (t.contiguous() for t in (q, dout, k_pool, v_pool, table))
    lse, delta = lse.contiguous(), delta.contiguous()
    dq = torch.zeros(B, H, Tq, D, device=q.device, dtype=torch.float32)
    if B * H * Tq * N == 0:
        return dq
    common = dict(G=G, P=P, D=D, BLOCK_D=_block_d(D), PRECISION=_precision(q.dtype, settings))
    args = (Tq, N, Hkv, first_page * P, q_start, scale * LOG2E, scale)
    strides = (*q.stride()[:3], *k_pool.stride()[:3], table.stride(0), *lse.stride()[:2])
    _dkv_kernel[(triton.cdiv(N * P, settings.dkv_block_n), B * Hkv)](
        q, dout, lse, delta, k_pool, v_pool, table, dk_pool, dv_pool, *strides, *dk_pool.stride()[:3], *args,
        BLOCK_M=settings.dkv_block_m, BLOCK_N=settings.dkv_block_n, num_warps=settings.dkv_warps,
        num_stages=settings.dkv_stages, **common)
    _dq_kernel[(triton.cdiv(Tq * G, settings.dq_block_m), B * Hkv)](
        q, dout, lse, delta, k_pool, v_pool, table, dq, *strides, *args,
        BLOCK_M=settings.dq_block_m, BLOCK_N=settings.dq_block_n, num_warps=settings.dq_warps,
        num_stages=settings.dq_stages, **common)
    return dq


def _block_d(D: int) -> int:
    return max(16, 1 << math.ceil(math.log2(D)))
