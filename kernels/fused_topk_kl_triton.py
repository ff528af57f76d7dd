"""The GPU path of the fused lm-head + top-k KL loss (``fused_topk_kl``'s default on CUDA): the
gradients are taken during the forward, as Liger-Kernel's fused linear losses do, so forward +
backward costs three matmuls: z = h_c W^T, grad_h_c = G W and grad_W += G^T h_c, chunk after chunk.

The loss, its tail modes and its notation are in kernels/fused_topk_kl_torch.py, beside the dense
reference and the chunked torch path that the tests hold this path to. Entry points:
``fused_topk_kl_triton`` (inputs validated by ``fused_topk_kl``), ``triton_forward`` (the same
without autograd), ``row_kernel_for`` (which row kernel a call runs) and ``triton_chunk_size``.
Sampled targets (``target_weights``) take the same routes: each row kernel reads the row's [k]
weights where the other targets take exp(log P) (the WEIGHTED constexpr), nothing more.

Row kernels. Between the matmuls one Triton program per row turns the chunk's input-dtype logits
into its gradient, in place. Two kernels, routed by ``row_kernel_for``:

The scaled row kernel (the gradient route): the softmax needs the row's logsumexp before any G can
be written, which would take a read for the statistics and a second read to write G. Instead the
pass exponentiates against a reference known before it starts, c = the largest logit on the
teacher's top-k S (gathered first): E = exp(z / T - c) is written over z while its sum is taken,
then lse = c + log(sum E). Outside S (and the target) the gradient is cd * softmax =
(cd / sum E) * E = sigma * E with one coefficient cd per row, so the row is left as E' = G / sigma
(the exact values at S and the target divided by sigma) and the per-row sigma moves into the small
matmul operands: grad_h = sigma * (E' W) (scaled in backward, with d loss) and
G^T h = E'^T (sigma * h), sigma * h written by the same program. One read and one write per logit
instead of two reads and one write (fused KL round 4 in tests/benchmarks/notes: it replaced the
direct kernel on this route). The reference only moves up (and earlier blocks are rescaled) where a
logit passes c + 20, which keeps E <= e^20 in bf16 / fp32.

The direct row kernel, for what the scaled one cannot take: forward-only calls (no gradient to
write; evaluation), fp16 (E would overflow its exponent range), CE at T != 1 (two softmaxes, no one
sigma) and renorm without CE (its gradient outside S is exactly zero, which one sigma cannot keep).
Per row it (1) gathers z at S and writes -inf there, (2) takes the logsumexps of z / T (and of z,
for CE at T != 1) over the columns outside S in one online pass (the bucket tail needs exactly
those; the full ones follow by adding the gathered S back in), (3) computes the row's loss and its
coefficients on [k] (as _kl_terms does in torch) and the exact gradient values at S and the
target, (4) re-reads the row, mostly from L2, writing cq q + c1 softmax(z) over it in place (0 at
S), and (5) stores the exact values at the target and at S (S wins where the target is in S).

Schedule: one stream and one reused logits buffer, chunk after chunk. A two-buffer, side-stream
schedule that overlapped a chunk's row pass with the previous chunk's gradient matmuls bought
nothing on the H200 and halved the chunk that fits the memory budget, so it was removed (commit
493ecb7; fused KL round 2 in tests/benchmarks/notes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fused_topk_kl_torch import FusedKLSettings, LossSpec, reduced, row_weights, teacher_values

_TAIL_CODE = {"renorm": 0, "bucket": 1, "unnormalized": 2}


@triton.jit
def _plogp_diff_tl(logp, logq):
    """P (log P - log Q), 0 where P = 0 (padding included; no inf - inf is formed)."""
    some = logp > float("-inf")
    lp = tl.where(some, logp, 0.0)
    return tl.where(some, tl.exp(lp) * (lp - tl.where(some, logq, 0.0)), 0.0)


@triton.jit
def _weighted_diff_tl(w, logp, logq):
    """w (log P - log Q), 0 where w = 0 (sampled padding slots and BLOCK_K padding: no inf - inf)."""
    some = w != 0
    return tl.where(some, w * (tl.where(some, logp, 0.0) - tl.where(some, logq, 0.0)), 0.0)


@triton.jit
def _teacher_mass(w_ptr, logp, offs, kmask, WEIGHTED: tl.constexpr):
    """P over S [BLOCK_K]: exp(log P), or a sampled target's weights, which take its place."""
    if WEIGHTED:
        p = tl.load(w_ptr + offs, mask=kmask, other=0.0)
    else:
        p = tl.exp(logp)
    return p


@triton.jit
def _logaddexp_tl(a, b):
    """log(exp(a) + exp(b)), -inf where both are (no inf - inf is formed)."""
    m = tl.maximum(a, b)
    ref = tl.where(m == float("-inf"), 0.0, m)
    return tl.where(m == float("-inf"), float("-inf"), ref + tl.log(tl.exp(a - ref) + tl.exp(b - ref)))


@triton.jit
def _jsd_and_coefs(logq, q, logp, logp_tail, log_qtail, beta):
    """The bucket form's generalised JSD and its coefficients, as jsd_terms in
    kernels/fused_topk_kl_torch.py: (jsd, cq, cs [BLOCK_K]); padding slots (q = 0) give 0."""
    log_b = tl.log(beta)
    log_1b = tl.log(1.0 - beta)
    logm = _logaddexp_tl(log_b + logp, log_1b + logq)
    logm_tail = _logaddexp_tl(log_b + logp_tail, log_1b + log_qtail)
    jsd = beta * (tl.sum(_plogp_diff_tl(logp, logm), axis=0) + _plogp_diff_tl(logp_tail, logm_tail)) \
        + (1.0 - beta) * (tl.sum(_plogp_diff_tl(logq, logm), axis=0) + _plogp_diff_tl(log_qtail, logm_tail))
    some = q > 0
    a = tl.where(some, (1.0 - beta) * q * (tl.where(some, logq, 0.0) - tl.where(some, logm, 0.0)), 0.0)
    has_tail = log_qtail > float("-inf")
    r = tl.where(has_tail, (1.0 - beta) * (tl.where(has_tail, log_qtail, 0.0) - tl.where(has_tail, logm_tail, 0.0)),
                 0.0)
    cq = r * (1.0 - tl.exp(log_qtail)) - tl.sum(a, axis=0)
    return jsd, cq, a - r * q


@triton.jit
def _kl_and_coefs(logq, q, logp, p, logp_tail_ptr, tail_ref, tail_sum, lse, beta, TAIL: tl.constexpr,
                  WEIGHTED: tl.constexpr, JSD: tl.constexpr):
    """A row's KL over S (plus the tail bucket) and its gradient coefficients before weighting:
    (kl, cq on q, cs [BLOCK_K] on S), the formulas of kernels/fused_topk_kl_torch.py as _kl_terms
    takes them in torch. logq, q, logp over S (padding: logp = -inf); p: _teacher_mass (WEIGHTED:
    sampled targets' weights, unnormalized only); bucket only: log Q_tail = tail_ref +
    log(tail_sum) - lse, tail_sum the sum of exp(z / T - tail_ref) outside S. JSD (bucket only):
    the generalised JSD at beta in the KL's place."""
    if JSD:
        kl, cq, cs = _jsd_and_coefs(logq, q, logp, tl.load(logp_tail_ptr), tail_ref + tl.log(tail_sum) - lse, beta)
    elif TAIL == 0:  # renorm
        mq = tl.max(logq, axis=0)
        logqhat = logq - (mq + tl.log(tl.sum(tl.exp(logq - mq), axis=0)))
        kl = tl.sum(_plogp_diff_tl(logp, logqhat), axis=0)
        cq = tl.zeros((), tl.float32)
        cs = tl.exp(logqhat) - p
    elif TAIL == 1:  # bucket
        logp_tail = tl.load(logp_tail_ptr)
        log_qtail = tail_ref + tl.log(tail_sum) - lse
        kl = tl.sum(_plogp_diff_tl(logp, logq), axis=0) + _plogp_diff_tl(logp_tail, log_qtail)
        ratio = tl.exp(logp_tail - log_qtail)
        cq = 1.0 - ratio
        cs = q * ratio - p
    else:  # unnormalized
        if WEIGHTED:
            kl = tl.sum(_weighted_diff_tl(p, logp, logq), axis=0)
        else:
            kl = tl.sum(_plogp_diff_tl(logp, logq), axis=0)
        cq = tl.sum(p, axis=0)
        cs = -p
    return kl, cq, cs


@triton.jit
def _row_kernel(z_ptr, stride_row, ids_ptr, logp_ptr, logp_tail_ptr, w_ptr, tgt_ptr, kl_w_ptr, ce_w_ptr, loss_ptr,
                kl_ptr, K, V, inv_temp, beta, TAIL: tl.constexpr, WEIGHTED: tl.constexpr, JSD: tl.constexpr,
                HAS_TARGET: tl.constexpr, BOTH: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
                BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_row
    # The row's top-k: logits zs, ids, teacher log P (all [BLOCK_K], padded with -inf / -1).
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    ids = tl.load(ids_ptr + row * K + ks, mask=kmask, other=-1)
    zs = tl.load(base + ids, mask=kmask, other=float("-inf")).to(tl.float32)
    tl.debug_barrier()  # every thread has read S before any writes -inf there
    tl.store(base + ids, tl.full((BLOCK_K,), float("-inf"), tl.float32).to(z_ptr.dtype.element_ty),
             mask=kmask)
    tl.debug_barrier()  # the -inf stores are visible to the whole program before the pass
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    m1 = tl.full((), float("-inf"), tl.float32)
    s1 = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):  # online logsumexp over the columns outside S (-inf at S)
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        xs = x * inv_temp
        new_m = tl.maximum(m, tl.max(xs, axis=0))
        ref = tl.where(new_m == float("-inf"), 0.0, new_m)  # an all -inf prefix: no NaN
        s = s * tl.exp(m - ref) + tl.sum(tl.exp(xs - ref), axis=0)
        m = new_m
        if BOTH:
            new_m1 = tl.maximum(m1, tl.max(x, axis=0))
            ref1 = tl.where(new_m1 == float("-inf"), 0.0, new_m1)
            s1 = s1 * tl.exp(m1 - ref1) + tl.sum(tl.exp(x - ref1), axis=0)
            m1 = new_m1
    logp = tl.load(logp_ptr + row * K + ks, mask=kmask, other=float("-inf"))
    top = tl.maximum(m, tl.max(zs * inv_temp, axis=0))  # finite: S is not empty
    lse = top + tl.log(s * tl.exp(m - top) + tl.sum(tl.exp(zs * inv_temp - top), axis=0))
    lse1 = lse
    if BOTH:
        top1 = tl.maximum(m1, tl.max(zs, axis=0))
        lse1 = top1 + tl.log(s1 * tl.exp(m1 - top1) + tl.sum(tl.exp(zs - top1), axis=0))
    logq = zs * inv_temp - lse
    q = tl.exp(logq)
    kl_w = tl.load(kl_w_ptr + row)
    p = _teacher_mass(w_ptr, logp, row * K + ks, kmask, WEIGHTED)
    kl, cq, cs = _kl_and_coefs(logq, q, logp, p, logp_tail_ptr + row, m, s, lse, beta, TAIL, WEIGHTED, JSD)
    loss = tl.where(kl_w != 0, kl_w * kl, 0.0)
    scale = tl.where(kl_w != 0, kl_w * inv_temp, 0.0)  # masked rows: 0, even if NaN
    cq = tl.where(scale != 0, scale * cq, 0.0)
    cs = tl.where(scale != 0, scale * cs, 0.0)
    c1 = 0.0
    if HAS_TARGET:
        c1 = tl.load(ce_w_ptr + row)
        t = tl.load(tgt_ptr + row)
        t0 = tl.maximum(t, 0)
        hits = tl.sum(tl.where(ids == t0, 1, 0), axis=0)
        z_t = tl.where(hits > 0, tl.sum(tl.where(ids == t0, zs, 0.0), axis=0),
                       tl.load(base + t0).to(tl.float32))
        loss += tl.where(c1 != 0, c1 * (lse1 - z_t), 0.0)
    tl.store(loss_ptr + row, loss)
    tl.store(kl_ptr + row, tl.where(kl_w != 0, kl, 0.0))
    if WRITE_GRAD:
        cd = cq if BOTH else cq + c1  # one softmax serves both terms unless CE is at T != 1
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32)
            g = cd * tl.exp(x * inv_temp - lse)
            if BOTH:
                g += c1 * tl.exp(x - lse1)
            tl.store(base + offs, g.to(z_ptr.dtype.element_ty), mask=offs < V)
        g_s = cq * q + cs
        tl.debug_barrier()  # the dense stores land before the exact values overwrite them
        if HAS_TARGET:  # rows with no target write the exact dense value at column 0
            g_s += c1 * (tl.exp(zs - lse1) - tl.where(ids == t, 1.0, 0.0))
            g_t = cq * tl.exp(z_t * inv_temp - lse) + c1 * tl.exp(z_t - lse1) - c1
            tl.store(base + t0, g_t.to(z_ptr.dtype.element_ty), mask=hits == 0)
        tl.store(base + ids, g_s.to(z_ptr.dtype.element_ty), mask=kmask)


@triton.jit
def _row_kernel_scaled(z_ptr, stride_row, ref_ptr, num_blocks, ids_ptr, logp_ptr, logp_tail_ptr, w_ptr, tgt_ptr,
                       kl_w_ptr, ce_w_ptr, loss_ptr, kl_ptr, sigma_ptr, h_ptr, hs_ptr, stride_h, D, K, V,
                       inv_temp, beta,
                       TAIL: tl.constexpr, WEIGHTED: tl.constexpr, JSD: tl.constexpr, HAS_TARGET: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """One read and one write per logit: the row becomes E' with d loss / d z = sigma * E'.

    The reference c is the row's largest logit over S (known before the pass, from the gathered
    S), so E = exp(z / T - c) can be written in the same pass that sums it: outside S and the
    target, G = (cd / sum E) E = sigma E; at S and the target the pass stores G / sigma. The
    reference moves up only if a block's maximum passes c + 20 (E stays <= e^20, no overflow);
    the blocks written under an older reference are then rescaled in a second pass (rare: a
    student logit 20 nats above all of its logits on the teacher's top-k). Last, the row of h
    is written scaled by sigma into hs, for grad_W += E'^T hs.
    """
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_row
    kl_w = tl.load(kl_w_ptr + row)
    masked = kl_w == 0
    c1 = 0.0
    if HAS_TARGET:
        c1 = tl.load(ce_w_ptr + row)
        masked = masked & (c1 == 0)
    sigma = tl.zeros((), tl.float32)
    if masked:  # a masked row: zero gradient (sigma 0); its finite logits stay in the buffer
        tl.store(loss_ptr + row, 0.0)
        tl.store(kl_ptr + row, 0.0)
    else:
        ks = tl.arange(0, BLOCK_K)
        kmask = ks < K
        ids = tl.load(ids_ptr + row * K + ks, mask=kmask, other=-1)
        xs = tl.load(base + ids, mask=kmask, other=float("-inf")).to(tl.float32) * inv_temp
        c0 = tl.max(xs, axis=0)  # finite: S is not empty
        if HAS_TARGET:
            t = tl.load(tgt_ptr + row)
            t0 = tl.maximum(t, 0)
            hits = tl.sum(tl.where(ids == t0, 1, 0), axis=0)
            z_t = tl.where(hits > 0, tl.sum(tl.where(ids == t0, xs, 0.0), axis=0),
                           tl.load(base + t0).to(tl.float32))  # inv_temp is 1 when a target is in play
        tl.debug_barrier()  # every thread has read S and the target before any write
        tl.store(base + ids, tl.full((BLOCK_K,), float("-inf"), tl.float32).to(z_ptr.dtype.element_ty),
                 mask=kmask)
        tl.debug_barrier()
        c = c0
        s_vec = tl.zeros((BLOCK,), tl.float32)  # summed across lanes once, after the pass
        for start in range(0, V, BLOCK):  # E = exp(z / T - c) outside S (0 at S), and its sum
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temp
            block_max = tl.max(x, axis=0)
            new_c = tl.where(block_max > c + 20.0, block_max, c)
            s_vec = s_vec * tl.exp(c - new_c)
            c = new_c
            e = tl.exp(x - c)
            s_vec += e
            tl.store(base + offs, e.to(z_ptr.dtype.element_ty), mask=offs < V)
            tl.store(ref_ptr + row * num_blocks + start // BLOCK, c)
        s = tl.sum(s_vec, axis=0)
        if c != c0:  # rescale the blocks written under an older reference
            tl.debug_barrier()
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                factor = tl.exp(tl.load(ref_ptr + row * num_blocks + start // BLOCK) - c)
                x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32) * factor
                tl.store(base + offs, x.to(z_ptr.dtype.element_ty), mask=offs < V)
        s_all = s + tl.sum(tl.exp(xs - c), axis=0)
        lse = c + tl.log(s_all)
        logp = tl.load(logp_ptr + row * K + ks, mask=kmask, other=float("-inf"))
        logq = xs - lse
        q = tl.exp(logq)
        p = _teacher_mass(w_ptr, logp, row * K + ks, kmask, WEIGHTED)
        kl, cq, cs = _kl_and_coefs(logq, q, logp, p, logp_tail_ptr + row, c, s, lse, beta, TAIL, WEIGHTED, JSD)
        loss = tl.where(kl_w != 0, kl_w * kl, 0.0)
        scale = tl.where(kl_w != 0, kl_w * inv_temp, 0.0)
        cq = tl.where(scale != 0, scale * cq, 0.0)
        cs = tl.where(scale != 0, scale * cs, 0.0)
        g_s = cq * q + cs
        if HAS_TARGET:
            loss += tl.where(c1 != 0, c1 * (lse - z_t), 0.0)
            g_s += c1 * (q - tl.where(ids == t, 1.0, 0.0))
        tl.store(loss_ptr + row, loss)
        tl.store(kl_ptr + row, tl.where(kl_w != 0, kl, 0.0))
        # Outside S: G = cd q = (cd / s_all) E. A coefficient cd near 0 (renorm has none; bucket
        # when the tails match) is floored at 1e-10 of the row's weight: the gradient outside S
        # is then off by at most that times q, and G / sigma at S stays finite.
        cd = cq + c1
        floor = 1e-10 * tl.maximum(tl.abs(scale), tl.abs(c1))
        cd = tl.where(tl.abs(cd) >= floor, cd, floor)
        sigma = cd / s_all
        inv_sigma = s_all / cd
        tl.debug_barrier()  # the pass's stores land before the exact values overwrite them
        if HAS_TARGET:
            g_t = (cq + c1) * tl.exp(z_t - lse) - c1
            tl.store(base + t0, (g_t * inv_sigma).to(z_ptr.dtype.element_ty), mask=(hits == 0) & (t >= 0))
        tl.store(base + ids, (g_s * inv_sigma).to(z_ptr.dtype.element_ty), mask=kmask)
    tl.store(sigma_ptr + row, sigma)
    for start in range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        h = tl.load(h_ptr + row * stride_h + offs, mask=offs < D, other=0.0).to(tl.float32)
        tl.store(hs_ptr + row * D + offs, (h * sigma).to(hs_ptr.dtype.element_ty), mask=offs < D)


@triton.jit
def _scale_kernel(x_ptr, num_rows, num_cols, factor_ptr, scalar_ptr, HAS_FACTOR: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """x [rows, cols] (contiguous) *= factor[row] * scalar, in place; without a factor, a scalar of
    exactly 1 (the usual d loss / d loss) leaves x untouched and reads nothing more."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    where = (rows[:, None] < num_rows) & (cols[None, :] < num_cols)
    ptrs = x_ptr + rows[:, None] * num_cols + cols[None, :]
    scalar = tl.load(scalar_ptr).to(tl.float32)
    if HAS_FACTOR:
        f = tl.load(factor_ptr + rows, mask=rows < num_rows, other=0.0) * scalar
        x = tl.load(ptrs, mask=where, other=0.0).to(tl.float32) * f[:, None]
        tl.store(ptrs, x.to(x_ptr.dtype.element_ty), mask=where)
    else:
        if scalar != 1.0:
            x = tl.load(ptrs, mask=where, other=0.0).to(tl.float32) * scalar
            tl.store(ptrs, x.to(x_ptr.dtype.element_ty), mask=where)


def row_kernel_for(write_grad: bool, tail: str, has_target: bool, temperature: float, dtype: torch.dtype) -> str:
    """The row kernel a call runs: "scaled" (the gradient route), "direct" (a gradient the scaled
    kernel cannot take: fp16, CE at T != 1, renorm without CE) or "forward" (the direct kernel
    without its gradient pass: nothing needs a gradient). has_target: CE is in the loss."""
    if not write_grad:
        return "forward"
    if dtype == torch.float16 or (has_target and temperature != 1.0) or (tail == "renorm" and not has_target):
        return "direct"
    return "scaled"


def _row_pass(z_CV, ids_CK, logp_CK, logp_tail_C, target_C, kl_w_C, ce_w_C, loss_C, kl_C, h_C, sigma_C, hs_C,
              tail, inv_temp, kernel, settings: FusedKLSettings, w_CK=None, jsd_beta=None) -> None:
    """Per-row loss into loss_C and unweighted KL into kl_C (fp32; 0 on rows of KL weight 0);
    w_CK: sampled targets' weights (fp32 [C, k], contiguous) or None; jsd_beta: the generalised
    JSD's beta in the KL's place, or None.
    kernel "direct": z_CV (the chunk's input-dtype logits) is overwritten with the gradient
    G = d loss / d z itself; "scaled": with E' such that G = sigma[:, None] * E', sigma into
    sigma_C [C] (fp32) and sigma[:, None] * h_C into hs_C; "forward": z_CV is left with -inf at S."""
    rows, vocab = z_CV.shape
    k = ids_CK.shape[1]
    has_target = target_C is not None
    weighted = w_CK is not None
    w_arg = w_CK if weighted else logp_CK  # not read without weights
    jsd, beta = jsd_beta is not None, 0.5 if jsd_beta is None else jsd_beta  # beta: not read without JSD
    if kernel == "scaled":
        block = min(settings.scaled_block, triton.next_power_of_2(vocab))
        num_blocks = triton.cdiv(vocab, block)
        refs = torch.empty(rows, num_blocks, device=z_CV.device, dtype=torch.float32)
        dim = h_C.shape[1]
        _row_kernel_scaled[(rows,)](
            z_CV, z_CV.stride(0), refs, num_blocks, ids_CK, logp_CK,
            logp_tail_C if logp_tail_C is not None else kl_w_C, w_arg, target_C if has_target else kl_w_C,
            kl_w_C, ce_w_C, loss_C, kl_C, sigma_C, h_C, hs_C, h_C.stride(0), dim, k, vocab, inv_temp, beta,
            TAIL=_TAIL_CODE[tail], WEIGHTED=weighted, JSD=jsd, HAS_TARGET=has_target, BLOCK=block,
            BLOCK_K=triton.next_power_of_2(k),
            BLOCK_D=min(4096, triton.next_power_of_2(dim)), num_warps=settings.scaled_warps,
        )
        return
    _row_kernel[(rows,)](
        z_CV, z_CV.stride(0), ids_CK, logp_CK, logp_tail_C if logp_tail_C is not None else kl_w_C, w_arg,
        target_C if has_target else kl_w_C, kl_w_C, ce_w_C, loss_C, kl_C, k, vocab, inv_temp, beta,
        TAIL=_TAIL_CODE[tail], WEIGHTED=weighted, JSD=jsd, HAS_TARGET=has_target,
        BOTH=has_target and inv_temp != 1.0,
        WRITE_GRAD=kernel == "direct", BLOCK=min(settings.direct_block, triton.next_power_of_2(vocab)),
        BLOCK_K=triton.next_power_of_2(k), num_warps=settings.direct_warps,
    )


def _scale_(x, factor_N, scalar) -> None:
    """x [N, M] (contiguous) *= factor_N[:, None] * scalar in place, in one Triton pass at memory
    speed (torch's broadcasting multiply was several times slower: fused KL round 4 in
    tests/benchmarks/notes). scalar is a 0-dim tensor on x's device (no host sync); without a
    factor, scalar == 1 skips."""
    rows, cols = x.shape
    block_r, block_c = 16, 512
    _scale_kernel[(triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))](
        x, rows, cols, factor_N if factor_N is not None else scalar, scalar, HAS_FACTOR=factor_N is not None,
        BLOCK_R=block_r, BLOCK_C=block_c,
    )


class TritonForward(NamedTuple):
    """What the forward leaves: loss per row and KL per row (fp32 [N]); grad_h [N, d] and grad_w
    [V, d] before their scaling by d loss (None where not needed); sigma [N] (fp32) where
    grad_h's rows still need it (the scaled kernel), else None; the row kernel that ran."""

    loss_N: torch.Tensor
    kl_N: torch.Tensor
    grad_h: torch.Tensor | None
    grad_w: torch.Tensor | None
    sigma_N: torch.Tensor | None
    row_kernel: str


def triton_forward(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, spec: LossSpec,
                   chunk_size: int | None, settings: FusedKLSettings, grad_weight_fp32: bool, need_h: bool,
                   need_w: bool, target_weights=None) -> TritonForward:
    """The loss and, for the inputs in need_h / need_w, its gradients, chunk after chunk; inputs
    are assumed valid (see ``fused_topk_kl``). chunk_size None: ``triton_chunk_size``.
    target_weights: sampled targets' weights [N, k] or None."""
    # The first chunk's logits matmul is queued before the small [N]- and [N, k]-sized work
    # (teacher log-probs at T, row weights), so the GPU starts on the big work at once.
    hidden = hidden.contiguous()
    num_rows, vocab = hidden.shape[0], weight.shape[0]
    if chunk_size is None:
        chunk_size = triton_chunk_size(num_rows, vocab, weight.element_size(), settings.triton_chunk_bytes)
    chunk_rows = min(chunk_size, num_rows)
    # One buffer reused across chunks: a fresh one per chunk would be allocated while the last is
    # still referenced, raising the peak.
    buf = hidden.new_empty(chunk_rows, vocab)
    first = torch.mm(hidden[:chunk_rows], weight.T, out=buf)
    logp_NK, logp_tail_N, w_NK = teacher_values(topk_logprobs, tail_logmass, target_weights, spec, torch.float32)
    kl_w_N, ce_w_N = row_weights(mask, target_ids, num_rows, spec.ce_weight, spec.temperature, spec.reduction,
                                 hidden.device)
    kl_w_N, ce_w_N = kl_w_N.float(), ce_w_N.float()
    if spec.ce_weight == 0.0:
        target_ids = None
    kernel = row_kernel_for(need_h or need_w, spec.tail, target_ids is not None, spec.temperature, hidden.dtype)
    # grad_W accumulates in the weight's dtype by default, as Liger does, so the extra memory is the
    # logits buffer. The price in bf16: each chunk's addmm rounds the running sum to bf16 (up to
    # 2**-9 relative), a random walk of about sqrt(n) * 2**-9 of an entry after n chunks, more
    # where chunks cancel (test_triton_bf16_grad_weight_accumulation bounds it; the benchmark's
    # check measures it at the README's shapes). grad_weight_fp32=True keeps an fp32 accumulator
    # (4 V d bytes more) and adds each chunk's G^T h (rounded once to the input dtype) to it.
    grad_h = torch.empty_like(hidden) if need_h else None  # contiguous, as _scale_ needs
    grad_w = torch.zeros(weight.shape, device=weight.device) if need_w and grad_weight_fp32 else None
    loss_N = torch.empty(num_rows, device=hidden.device, dtype=torch.float32)
    kl_N, sigma_N = torch.empty_like(loss_N), torch.empty_like(loss_N)
    hs_buf = torch.empty_like(hidden[:chunk_rows])
    if settings.poison:  # every element below is a kernel's to write (hs_buf only on the scaled route)
        for t in (loss_N, kl_N, sigma_N, hs_buf):
            t.fill_(float("nan"))
    logp_NK = logp_NK.contiguous()
    w_NK = w_NK.contiguous() if w_NK is not None else None
    topk_ids = topk_ids.contiguous()
    for start in range(0, num_rows, chunk_size):
        rows = slice(start, min(start + chunk_size, num_rows))
        h_C = hidden[rows]
        z_CV = first if start == 0 else torch.mm(h_C, weight.T, out=buf[: h_C.shape[0]])
        _row_pass(z_CV, topk_ids[rows], logp_NK[rows], None if logp_tail_N is None else logp_tail_N[rows],
                  None if target_ids is None else target_ids[rows], kl_w_N[rows], ce_w_N[rows], loss_N[rows],
                  kl_N[rows], h_C, sigma_N[rows], hs_buf[: h_C.shape[0]], spec.tail, 1.0 / spec.temperature,
                  kernel, settings, None if w_NK is None else w_NK[rows], spec.jsd_beta)
        # z_CV holds G, or E' with G = sigma[:, None] * E'. Then grad_h = sigma * (E' W), its rows
        # scaled in backward together with d loss, and G^T h = E'^T (sigma * h).
        if need_h:
            torch.mm(z_CV, weight, out=grad_h[rows])
        if need_w:
            h_w = hs_buf[: h_C.shape[0]] if kernel == "scaled" else h_C
            if grad_weight_fp32:
                grad_w += z_CV.T @ h_w
            elif start == 0:
                grad_w = torch.mm(z_CV.T, h_w)
            else:
                grad_w.addmm_(z_CV.T, h_w)
    if need_w and grad_w is None:  # no rows
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=weight.dtype)
    return TritonForward(loss_N, kl_N, grad_h, grad_w, sigma_N if kernel == "scaled" else None, kernel)


class _FusedTopkKLTritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, spec, chunk_size,
                settings, grad_weight_fp32, need_h, need_w, target_weights):
        out = triton_forward(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, spec,
                             chunk_size, settings, grad_weight_fp32, need_h, need_w, target_weights)
        ctx.save_for_backward(out.grad_h, out.grad_w, out.sigma_N)
        ctx.weight_dtype, ctx.spent = weight.dtype, False
        ctx.mark_non_differentiable(out.kl_N)
        return reduced(out.loss_N, spec.reduction), out.kl_N

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl):
        if ctx.spent:
            raise RuntimeError("fused_topk_kl (impl='triton') scales its saved gradients in place, "
                               "so its backward can run once; recompute the loss for a second backward")
        ctx.spent = True
        grad_h, grad_w, sigma_N = ctx.saved_tensors
        assert grad_loss.dim() == 0, "reduction='none' with a gradient is refused by fused_topk_kl"
        grad_loss = grad_loss.float().contiguous()
        if grad_h is not None and grad_h.numel():
            _scale_(grad_h, sigma_N, grad_loss)
        if grad_w is not None and grad_w.numel():
            _scale_(grad_w, None, grad_loss)
            grad_w = grad_w.to(ctx.weight_dtype)
        return grad_h, grad_w, *([None] * 12)


def triton_chunk_size(num_rows: int, vocab_size: int, element_size: int, chunk_bytes: int) -> int:
    """Rows per chunk when chunk_size is None: the fewest chunks whose input-dtype logits fit
    chunk_bytes (FusedKLSettings.triton_chunk_bytes), made equal in size and rounded up to a
    multiple of 128 rows (never past the cap), so that no small last chunk runs the matmuls at low
    efficiency. The cap is rounded down to a multiple of 1,024 rows (of 128 below that): chunks
    just past a multiple of 1,024 rows ran slower than the multiple below them, likely because
    grad_h = G W then needs a second, nearly empty wave of output tiles (fused KL round 2 in
    tests/benchmarks/notes; not profiled). Example at the default budget: N = 12,288,
    V = 151,936, bf16: 6 chunks of 2,048."""
    cap = max(1, chunk_bytes // (element_size * vocab_size))
    step = 1024 if cap >= 1024 else 128
    cap = cap // step * step if cap >= 128 else cap
    if num_rows <= cap:
        return max(1, num_rows)
    per_chunk = -(-num_rows // -(-num_rows // cap))
    return min(cap, -(-per_chunk // 128) * 128) if cap >= 128 else per_chunk


def fused_topk_kl_triton(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask, spec: LossSpec,
                         chunk_size: int | None, settings: FusedKLSettings, grad_weight_fp32: bool, need_h: bool,
                         need_w: bool, target_weights=None):
    """Triton path: (loss, reduced; KL per row [N]), gradients for need_h / need_w taken during the
    forward and held until backward; inputs are assumed valid (see ``fused_topk_kl``)."""
    return _FusedTopkKLTritonFunction.apply(hidden, weight, topk_ids, topk_logprobs, tail_logmass, target_ids, mask,
                                            spec, chunk_size, settings, grad_weight_fp32, need_h, need_w,
                                            target_weights)
