"""The Triton kernels of kernels/twell_ffn.py's sparse path, in the order a call runs them: the
TwELL pack (per-tile counts and bit words, then each word's list position), each block of
tokens' union columns, the products by blocks (u and h, y; dh, dx), the re-zeroing of the
backward's dense rows and the backward of the rows that overflowed the backup.

The format they read and write, and why they are shaped as they are, are described in
kernels/twell_ffn.py, which launches them; its TwellSettings reach them as arguments. This
module imports nothing of ours. Every grid is one-dimensional (the programs of a two-level
iteration folded into program_id(0), the inner level fastest), so no grid dimension limits the
rows of a chunk.
"""

from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _positive(g):
    """g > 0 from the bits: a float is positive iff its bits as a signed int of its width are
    (-0.0 is negative there, +0.0 zero); no conversion to fp32 per element."""
    if g.dtype.primitive_bitwidth == 16:
        bits = g.to(tl.int16, bitcast=True)
    else:
        bits = g.to(tl.int32, bitcast=True)
    return bits > 0

@triton.jit
def _popc(v):
    """Set bits of each int32 (SWAR on its unsigned bits)."""
    v = v.to(tl.uint32, bitcast=True)
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return ((v * 0x01010101) >> 24).to(tl.int32)

@triton.jit
def _count_kernel(g_ptr, tile_count_ptr, words_ptr, active_ptr, row0, C, N, F, NW, NT,
                  BLOCK_M: tl.constexpr, ROW_BLOCKS: tl.constexpr, TILE_F: tl.constexpr):
    """Hidden tile pid % NT, rows [(pid // NT)*ROW_BLOCKS*BLOCK_M, ...) of the chunk's gate [C, F]:
    each row's number of positive entries in the tile (TwELL's per-tile count), the positive
    entries as bits (words [C, NW], bit b of word k: column 32k + b), and the tile's active
    columns (one store per program)."""
    t = tl.program_id(0) % NT
    row_prog = tl.program_id(0) // NT
    cols = t * TILE_F + tl.arange(0, TILE_F)
    wcols = t * (TILE_F // 32) + tl.arange(0, TILE_F // 32)
    seen = tl.zeros([BLOCK_M, TILE_F], dtype=tl.int32)
    for i in range(ROW_BLOCKS):
        r = (row_prog * ROW_BLOCKS + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        m2 = (r < C)[:, None] & (cols < F)[None, :]
        g = tl.load(g_ptr + r.to(tl.int64)[:, None] * F + cols[None, :], mask=m2, other=0.0)
        p = (_positive(g) & m2).to(tl.int32)
        grow = r.to(tl.int64) + row0
        tl.store(tile_count_ptr + grow + (tl.zeros_like(grow) + t) * N, tl.sum(p, axis=1), mask=r < C)
        bits = tl.reshape(p << (tl.arange(0, TILE_F) % 32)[None, :], [BLOCK_M, TILE_F // 32, 32])
        tl.store(words_ptr + r.to(tl.int64)[:, None] * NW + wcols[None, :], tl.sum(bits, axis=2),
                 mask=(r < C)[:, None])  # distinct bits: the sum is their OR
        seen = tl.maximum(seen, p)
    col_any = tl.max(seen, axis=0)
    tl.store(active_ptr + cols, col_any, mask=col_any > 0)  # every writer stores 1: benign race

@triton.jit
def _word_pos_kernel(words_ptr, wpos_ptr, start_ptr, row0, C, N, NW, NT, BLOCK_M: tl.constexpr,
                     ROW_BLOCKS: tl.constexpr, TILE_F: tl.constexpr):
    """Hidden tile pid % NT, rows [(pid // NT)*ROW_BLOCKS*BLOCK_M, ...) of the chunk: the list
    position of each bit word's lowest column (wpos [C, NW], like words): where the tile starts
    in the row's list plus the set bits of the tile's earlier words. _union_up_kernel and
    _union_dh_kernel add the bits below a column to find its list position."""
    t = tl.program_id(0) % NT
    row_prog = tl.program_id(0) // NT
    wcols = t * (TILE_F // 32) + tl.arange(0, TILE_F // 32)
    for i in range(ROW_BLOCKS):
        r = (row_prog * ROW_BLOCKS + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = r < C
        r64 = r.to(tl.int64)
        w = tl.load(words_ptr + r64[:, None] * NW + wcols[None, :], mask=rmask[:, None], other=0)
        cnt = _popc(w)
        grow = r64 + row0
        first = tl.load(start_ptr + grow + (tl.zeros_like(grow) + t) * N, mask=rmask, other=0)
        tl.store(wpos_ptr + r64[:, None] * NW + wcols[None, :], first[:, None] + tl.cumsum(cnt, axis=1) - cnt,
                 mask=rmask[:, None])

@triton.jit
def _union_kernel(words_ptr, ucnt_ptr, ucols_ptr, C, F, NW, BM: tl.constexpr, NWP: tl.constexpr):
    """Token block pid (chunk rows [pid*BM, ...)): the columns where any of its rows' gate is
    positive (the OR of their bit words), ascending, into ucols[pid, :ucnt[pid]]."""
    b = tl.program_id(0).to(tl.int64)
    wk = tl.arange(0, NWP)
    acc = tl.zeros([NWP], dtype=tl.int32)
    for i in range(BM):
        r = b * BM + i
        acc |= tl.load(words_ptr + r * NW + wk, mask=(wk < NW) & ((tl.zeros_like(wk) + r) < C), other=0)
    cnt = _popc(acc)
    pos = tl.cumsum(cnt, axis=0) - cnt
    tl.store(ucnt_ptr + b + tl.arange(0, 1), tl.zeros([1], dtype=tl.int32) + tl.sum(cnt, axis=0))
    for _ in range(0, tl.max(cnt, axis=0)):
        live = acc != 0
        tl.store(ucols_ptr + b * F + pos, wk * 32 + _popc((acc & (0 - acc)) - 1), mask=live)
        acc = acc & (acc - 1)
        pos += 1

@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b in fp32; fp32 inputs in full precision (not TF32). UPCAST: bf16 / fp16 inputs
    as fp32 (the same products and fp32 sums), for Triton's CPU interpreter, whose tl.dot reads
    bf16 inputs wrongly (checked with triton 3.6: errors of 1e10 on a 16 x 16 product)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)

@triton.jit
def _block_rows(ucnt_ptr, b, row0, C, F, BM: tl.constexpr, OFF64: tl.constexpr):
    """Token block b's union size, chunk rows r (and which exist), token rows m and r * F (in
    64 bits when OFF64)."""
    r = b * BM + tl.arange(0, BM)
    if OFF64:
        r_f = r.to(tl.int64) * F
    else:
        r_f = r * F
    return tl.load(ucnt_ptr + b), r, r < C, r.to(tl.int64) + row0, r_f

@triton.jit
def _rows_times_union(a_ptr, w_ptr, m, mr, cols, mq, D, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      UPCAST: tl.constexpr):
    """[BM, BN] fp32: a's rows m times w's rows cols (both [*, D]) over d_model, on the tensor
    cores; the block's rows share each fetched weight row. Computed as w a^T, [BN, BM], so that the
    product's M is BN: Hopper's wgmma needs M >= 64, and a block's BM is 16; as a w^T (M = 16)
    Triton takes mma.sync, which measured slower in both the up and the dh kernel, while the down
    kernels transposed the same way (M = the d_model slice) measured slower than as they are
    (RESULTS.md, "Sparse FFN"; the sweep is in notes/sparse-ffn.md)."""
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        mk = k < D
        a = tl.load(a_ptr + m[:, None] * D + k[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * D + k[None, :], mask=mq[:, None] & mk[None, :],
                    other=0.0)
        acc = _dot(w, tl.trans(a), acc, UPCAST)
    return tl.trans(acc)

@triton.jit
def _union_pattern(words_ptr, wpos_ptr, r, cols, m2, NW):
    """For chunk rows r and union columns cols: whether the row's gate is positive there (its
    bit word), and where the column sits in the row's list (the word's list position from wpos
    plus the set bits below it)."""
    word_off = r[:, None] * NW + (cols >> 5)[None, :]
    word = tl.load(words_ptr + word_off, mask=m2, other=0)
    pos = ((word >> (cols & 31)[None, :]) & 1) != 0
    below = (tl.full(pos.shape, 1, tl.uint32) << (cols & 31).to(tl.uint32)[None, :]) - 1
    p = tl.load(wpos_ptr + word_off, mask=pos, other=0) + _popc(word & below.to(tl.int32, bitcast=True))
    return pos, p

@triton.jit
def _list_masks(m, p, mp, slot, W, BW):
    """Where list positions p of row m live: (in ELL, offset there, in backup, offset there)."""
    in_ell = mp & (p < W)
    in_bk = mp & (p >= W)
    return in_ell, m * W + p, in_bk, tl.maximum(slot, 0).to(tl.int64) * BW + (p - W)

@triton.jit
def _list_load(ell_ptr, bk_ptr, in_ell, ell_off, in_bk, bk_off):
    """Values at list positions: from the ELL array where in_ell, the backup's where in_bk, else 0."""
    return tl.load(ell_ptr + ell_off, mask=in_ell, other=0) + tl.load(bk_ptr + bk_off, mask=in_bk, other=0)

@triton.jit
def _dh_values(dh_y, hg, u, l1_scale, dtype):
    """From relu(g), u and dh_y = (dy Wd)[n] (fp32): h, dh_u = dh relu(g), dh_g = dh u in dtype,
    with dh = dh_y + the L1 term, each rounded as the dense path rounds."""
    h = (hg * u).to(dtype).to(tl.float32)
    sign = tl.where(h > 0, 1.0, tl.where(h < 0, -1.0, 0.0))
    dh = (dh_y.to(dtype).to(tl.float32) + l1_scale * sign).to(dtype).to(tl.float32)
    return h.to(dtype), (dh * hg).to(dtype), (dh * u).to(dtype)

@triton.jit
def _union_up_kernel(x_ptr, wu_ptr, g_ptr, words_ptr, wpos_ptr, slot_ptr, ucnt_ptr, ucols_ptr, ell_idx_ptr,
                     ell_hg_ptr, ell_u_ptr, bk_idx_ptr, bk_hg_ptr, bk_u_ptr, h_ptr, l1_ptr, row0, C, D, F, NW, W,
                     BW, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                     OFF64: tl.constexpr, UPCAST: tl.constexpr):
    """Token block pid // SPLIT, its union columns [j*BN, ...) for j = pid % SPLIT, + SPLIT, ...: u = x W_up^T
    on the tensor cores over every (row, column) pair of the block, the rows' weights shared. At
    the pairs whose gate is positive: h = round(relu(g) u) into h's row at the union position
    (zero elsewhere, for _union_down_kernel), the column, relu(g) and u into the row's list
    (position from wpos and the word's lower bits; fallback rows keep no list); the program's sum
    |h| at l1[pid]. OFF64: chunk offsets r * F need 64 bits."""
    b = tl.program_id(0) // SPLIT
    n_u, r, mr, m, r_f = _block_rows(ucnt_ptr, b, row0, C, F, BM, OFF64)
    ucols_b = ucols_ptr + b.to(tl.int64) * F
    slot = tl.load(slot_ptr + m, mask=mr, other=-2)
    dtype = x_ptr.dtype.element_ty
    l1 = tl.zeros([BM], dtype=tl.float32)
    for j in range(tl.program_id(0) % SPLIT, tl.cdiv(n_u, BN), SPLIT):
        q = j * BN + tl.arange(0, BN)
        mq = q < n_u
        cols = tl.load(ucols_b + q, mask=mq, other=0)
        acc = _rows_times_union(x_ptr, wu_ptr, m, mr, cols, mq, D, BM, BN, BK, UPCAST)
        m2 = mr[:, None] & mq[None, :]
        pos, p = _union_pattern(words_ptr, wpos_ptr, r, cols, m2, NW)
        g = tl.load(g_ptr + r_f[:, None] + cols[None, :], mask=pos, other=0.0)
        u = acc.to(dtype)
        h = tl.where(pos, (g.to(tl.float32) * u.to(tl.float32)).to(dtype), 0.0).to(dtype)
        tl.store(h_ptr + r_f[:, None] + q[None, :], h, mask=m2)
        l1 += tl.sum(tl.abs(h.to(tl.float32)), axis=1)
        in_ell, ell_off, in_bk, bk_off = _list_masks(m[:, None], p, pos & (slot != -2)[:, None], slot[:, None], W,
                                                     BW)
        in_bk = in_bk & (slot >= 0)[:, None]
        col = tl.broadcast_to(cols[None, :], (BM, BN))
        tl.store(ell_idx_ptr + ell_off, col, mask=in_ell)
        tl.store(ell_hg_ptr + ell_off, g, mask=in_ell)
        tl.store(ell_u_ptr + ell_off, u, mask=in_ell)
        tl.store(bk_idx_ptr + bk_off, col, mask=in_bk)
        tl.store(bk_hg_ptr + bk_off, g, mask=in_bk)
        tl.store(bk_u_ptr + bk_off, u, mask=in_bk)
    tl.store(l1_ptr + tl.program_id(0) + tl.arange(0, 1),
             tl.zeros([1], dtype=tl.float32) + tl.sum(l1, axis=0))

@triton.jit
def _union_dh_kernel(dy_ptr, wdt_ptr, words_ptr, wpos_ptr, slot_ptr, ucnt_ptr, ucols_ptr, ell_hg_ptr, ell_u_ptr,
                     bk_hg_ptr, bk_u_ptr, l1_scale_ptr, h_ptr, dhug_ptr, dhu_ptr, dhg_ptr, row0, C, D, F, NW, W,
                     BW, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                     OFF64: tl.constexpr, UPCAST: tl.constexpr):
    """The backward's _union_up_kernel: token block pid // SPLIT, union columns [j*BN, ...)
    for j = pid % SPLIT, + SPLIT, ...: dh_y = dy W_down over every (row, column) pair of the block,
    then, at the pairs in the rows' lists (relu(g) and u read there), h, dh_u and dh_g as
    _dh_values gives them: into the chunk's dense rows at the columns (for the weight-gradient
    GEMMs) and at the union positions (zero elsewhere, for the dx product by blocks). Fallback
    rows are left to _fallback_bwd_kernel. OFF64: dense offsets r * 2F need 64 bits."""
    b = tl.program_id(0) // SPLIT
    n_u, r, mr, m, r_f = _block_rows(ucnt_ptr, b, row0, C, F, BM, OFF64)
    ucols_b = ucols_ptr + b.to(tl.int64) * F
    slot = tl.load(slot_ptr + m, mask=mr, other=-2)
    l1_scale = tl.load(l1_scale_ptr)
    dtype = dy_ptr.dtype.element_ty
    for j in range(tl.program_id(0) % SPLIT, tl.cdiv(n_u, BN), SPLIT):
        q = j * BN + tl.arange(0, BN)
        mq = q < n_u
        cols = tl.load(ucols_b + q, mask=mq, other=0)
        dh_y = _rows_times_union(dy_ptr, wdt_ptr, m, mr, cols, mq, D, BM, BN, BK, UPCAST)
        m2 = mr[:, None] & mq[None, :]
        pos, p = _union_pattern(words_ptr, wpos_ptr, r, cols, m2, NW)
        pos = pos & (slot != -2)[:, None]
        in_ell, ell_off, in_bk, bk_off = _list_masks(m[:, None], p, pos, slot[:, None], W, BW)
        in_bk = in_bk & (slot >= 0)[:, None]
        hg = _list_load(ell_hg_ptr, bk_hg_ptr, in_ell, ell_off, in_bk, bk_off).to(tl.float32)
        u = _list_load(ell_u_ptr, bk_u_ptr, in_ell, ell_off, in_bk, bk_off).to(tl.float32)
        h, dhu, dhg = _dh_values(dh_y, hg, u, l1_scale, dtype)
        dhu = tl.where(pos, dhu, 0.0).to(dtype)
        dhg = tl.where(pos, dhg, 0.0).to(dtype)
        tl.store(h_ptr + r_f[:, None] + cols[None, :], h, mask=pos)
        tl.store(dhug_ptr + 2 * r_f[:, None] + cols[None, :], dhu, mask=pos)
        tl.store(dhug_ptr + 2 * r_f[:, None] + F + cols[None, :], dhg, mask=pos)
        tl.store(dhu_ptr + r_f[:, None] + q[None, :], dhu, mask=m2)
        tl.store(dhg_ptr + r_f[:, None] + q[None, :], dhg, mask=m2)

@triton.jit
def _union_down_kernel(a_ptr, w_ptr, a2_ptr, w2_ptr, slot_ptr, ucnt_ptr, ucols_ptr, out_ptr, row0, C, D, F,
                       BM: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, TWO: tl.constexpr,
                       OFF64: tl.constexpr, UPCAST: tl.constexpr):
    """Token block pid // S, d_model columns [(pid % S)*BD, ...), S = cdiv(D, BD) slices: out = a w
    over the block's union columns (a at the union positions, [C, F]; w's rows at the columns,
    [F, D]), the rows' weights shared. Forward: a = h as _union_up_kernel left it, w = W_down^T: y.
    TWO (the backward): + a2 w2, with a, a2 = dh_u, dh_g from _union_dh_kernel and w, w2 = W_up,
    W_gate: dx, except at fallback rows (_fallback_bwd_kernel's)."""
    slices = tl.cdiv(D, BD)
    b, ds = tl.program_id(0) // slices, tl.program_id(0) % slices
    n_u, _, mr, m, r_f = _block_rows(ucnt_ptr, b, row0, C, F, BM, OFF64)
    ucols_b = ucols_ptr + b.to(tl.int64) * F
    k = ds * BD + tl.arange(0, BD)
    mk = k < D
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for q0 in range(0, n_u, BK):
        q = q0 + tl.arange(0, BK)
        mq = q < n_u
        cols = tl.load(ucols_b + q, mask=mq, other=0).to(tl.int64)
        mw = mq[:, None] & mk[None, :]
        a = tl.load(a_ptr + r_f[:, None] + q[None, :], mask=mr[:, None] & mq[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * D + k[None, :], mask=mw, other=0.0)
        acc = _dot(a, w, acc, UPCAST)
        if TWO:
            a2 = tl.load(a2_ptr + r_f[:, None] + q[None, :], mask=mr[:, None] & mq[None, :], other=0.0)
            w2 = tl.load(w2_ptr + cols[:, None] * D + k[None, :], mask=mw, other=0.0)
            acc = _dot(a2, w2, acc, UPCAST)
    if TWO:
        mr = mr & (tl.load(slot_ptr + m, mask=mr, other=-2) != -2)
    tl.store(out_ptr + m[:, None] * D + k[None, :], acc.to(out_ptr.dtype.element_ty), mask=mr[:, None] & mk[None, :])

@triton.jit
def _clear_kernel(count_ptr, slot_ptr, ell_idx_ptr, bk_idx_ptr, h_ptr, dhug_ptr, row0, F, W, BW,
                  BLOCK: tl.constexpr):
    """Chunk row pid: zero what the backward wrote into its dense rows (h, dh_u, dh_g at the
    row's list; the whole row for a fallback row), so the buffers start the next chunk zeroed."""
    r = tl.program_id(0).to(tl.int64)
    m = r + row0
    slot = tl.load(slot_ptr + m)
    is_fb = slot == -2
    num = tl.where(is_fb, F, tl.load(count_ptr + m))
    zero = tl.zeros([BLOCK], dtype=h_ptr.dtype.element_ty)
    for q0 in range(0, num, BLOCK):
        p = q0 + tl.arange(0, BLOCK)
        mp = p < num
        in_ell, ell_off, in_bk, bk_off = _list_masks(m, p, mp, slot, W, BW)
        in_ell = in_ell & ((tl.zeros_like(p) + slot) != -2)
        in_bk = in_bk & ((tl.zeros_like(p) + slot) != -2)
        n = _list_load(ell_idx_ptr, bk_idx_ptr, in_ell, ell_off, in_bk, bk_off)
        n64 = tl.where((tl.zeros_like(p) + slot) == -2, p, n).to(tl.int64)
        tl.store(h_ptr + r * F + n64, zero, mask=mp)
        tl.store(dhug_ptr + r * 2 * F + n64, zero, mask=mp)
        tl.store(dhug_ptr + r * 2 * F + F + n64, zero, mask=mp)

@triton.jit
def _fallback_row_slot(slot_ptr, m, r, C):
    """The row's slot, or -1 (not a fallback row) past the chunk's end r >= C."""
    return tl.where(r < C, tl.load(slot_ptr + tl.minimum(m, m - r + C - 1)), -1)

@triton.jit
def _fallback_bwd_kernel(x_ptr, dy_ptr, wg_ptr, wu_ptr, wdt_ptr, slot_ptr, l1_scale_ptr, h_ptr, dhug_ptr,
                         dx_ptr, row0, C, D, F, ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """Chunk rows [pid*ROWS, ...), for each fallback row among them: gate and up recomputed
    from x at every hidden column, dh (with the L1 term), dh_u, dh_g scattered with h into the
    chunk's dense rows, and dx = sum dh_u Wu[n] + dh_g Wg[n]."""
    for i in range(ROWS):
        _fallback_bwd_row(x_ptr, dy_ptr, wg_ptr, wu_ptr, wdt_ptr, slot_ptr, l1_scale_ptr, h_ptr, dhug_ptr,
                          dx_ptr, row0, (tl.program_id(0) * ROWS + i).to(tl.int64), C, D, F, BLOCK_S, BLOCK_D)

@triton.jit
def _fallback_bwd_row(x_ptr, dy_ptr, wg_ptr, wu_ptr, wdt_ptr, slot_ptr, l1_scale_ptr, h_ptr, dhug_ptr,
                      dx_ptr, row0, r, C, D, F, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    m = r + row0
    slot = _fallback_row_slot(slot_ptr, m, r, C)
    num = tl.where(slot == -2, F, 0)
    dtype = x_ptr.dtype.element_ty
    l1_scale = tl.load(l1_scale_ptr)
    k = tl.arange(0, BLOCK_D)
    mk = (k < D) & ((tl.zeros_like(k) + slot) == -2)
    dyk = tl.load(dy_ptr + m * D + k, mask=mk, other=0.0).to(tl.float32)
    xk = tl.load(x_ptr + m * D + k, mask=mk, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ms = s < num
        s64 = s.to(tl.int64)
        m2 = ms[:, None] & mk[None, :]
        w_d = tl.load(wdt_ptr + s64[:, None] * D + k[None, :], mask=m2, other=0.0).to(tl.float32)
        w_g = tl.load(wg_ptr + s64[:, None] * D + k[None, :], mask=m2, other=0.0).to(tl.float32)
        w_u = tl.load(wu_ptr + s64[:, None] * D + k[None, :], mask=m2, other=0.0).to(tl.float32)
        hg = tl.maximum(tl.sum(w_g * xk[None, :], axis=1).to(dtype).to(tl.float32), 0.0)
        u = tl.sum(w_u * xk[None, :], axis=1).to(dtype).to(tl.float32)
        live = ms & (hg > 0)
        h = (hg * u).to(dtype).to(tl.float32)
        sign = tl.where(h > 0, 1.0, tl.where(h < 0, -1.0, 0.0))
        dh_y = tl.sum(w_d * dyk[None, :], axis=1).to(dtype).to(tl.float32)
        dh = (dh_y + l1_scale * sign).to(dtype).to(tl.float32)
        dhu = tl.where(live, (dh * hg).to(dtype).to(tl.float32), 0.0)
        dhg = tl.where(live, (dh * u).to(dtype).to(tl.float32), 0.0)
        tl.store(h_ptr + r * F + s64, h.to(dtype), mask=live)
        tl.store(dhug_ptr + r * 2 * F + s64, dhu.to(dtype), mask=live)
        tl.store(dhug_ptr + r * 2 * F + F + s64, dhg.to(dtype), mask=live)
        acc += tl.sum(w_u * dhu[:, None] + w_g * dhg[:, None], axis=0)
    tl.store(dx_ptr + m * D + k, acc.to(dtype), mask=mk)
