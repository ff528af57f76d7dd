"""Triton kernels of kernels/page_select.py (imports nothing of ours): a chunk's queries against its
past pages' mean keys, the softmax over the pages summed over the queries, in two passes that never
hold the [queries, pages] scores: each query's logsumexp over the pages, then each page's mass."""

import triton
import triton.language as tl


@triton.jit
def _lse_kernel(q_ptr, k_ptr, lse_ptr, T, J, stride_kj, D: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_J: tl.constexpr, PRECISION: tl.constexpr):
    """lse[bh, t] = log sum_j exp(q[bh, t] . k[j, bh]) for a block of BLOCK_T queries of one
    (row, kv head) bh: q [BH, T, D] contiguous, k's page j of bh at j * stride_kj + bh * D."""
    pid_t, bh = tl.program_id(0), tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + bh * T * D + offs_t[:, None] * D + offs_d[None, :], mask=offs_t[:, None] < T, other=0.0)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_T], tl.float32)
    for j0 in range(0, J, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        k = tl.load(k_ptr + offs_j[:, None] * stride_kj + bh * D + offs_d[None, :], mask=offs_j[:, None] < J,
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(offs_j[None, :] < J, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
    tl.store(lse_ptr + bh * T + offs_t, m + tl.log(total), mask=offs_t < T)


@triton.jit
def _mass_kernel(q_ptr, k_ptr, lse_ptr, mass_ptr, T, J, stride_kj, D: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_J: tl.constexpr, PRECISION: tl.constexpr):
    """mass[bh, j] = sum_t exp(q[bh, t] . k[j, bh] - lse[bh, t]) for a block of BLOCK_J pages of
    one (row, kv head) bh, over all T queries (a query past T adds nothing: its lse is +inf)."""
    pid_j, bh = tl.program_id(0), tl.program_id(1)
    offs_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    offs_d = tl.arange(0, D)
    k = tl.load(k_ptr + offs_j[:, None] * stride_kj + bh * D + offs_d[None, :], mask=offs_j[:, None] < J, other=0.0)
    acc = tl.zeros([BLOCK_J], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        q = tl.load(q_ptr + bh * T * D + offs_t[:, None] * D + offs_d[None, :], mask=offs_t[:, None] < T, other=0.0)
        lse = tl.load(lse_ptr + bh * T + offs_t, mask=offs_t < T, other=float("inf"))
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        acc += tl.sum(tl.exp(s - lse[:, None]), 0)
    tl.store(mass_ptr + bh * J + offs_j, acc, mask=offs_j < J)
