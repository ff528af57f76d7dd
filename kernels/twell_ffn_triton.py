"""The Triton kernels of kernels/twell_ffn.py's sparse path (the TwELL pack, the gather SDDMM and
SpMM, the backward's dh kernel, the re-zeroing, the fallback kernels, and the kernels by blocks
of tokens: their union columns, u / h and dh on them, and y / dx over them).

The format they read and write, why they are shaped as they are and the order in which they run
are described in kernels/twell_ffn.py, above its block sizes; that module launches them (its
block sizes and switches reach them as arguments, so the tests and benchmarks set them there).
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
def _count_kernel(g_ptr, tile_count_ptr, words_ptr, active_ptr, row0, C, N, F, NW,
                  BLOCK_M: tl.constexpr, ROW_BLOCKS: tl.constexpr, TILE_F: tl.constexpr):
    """Hidden tile pid0, rows [pid1*ROW_BLOCKS*BLOCK_M, ...) of the chunk's gate [C, F]: each
    row's number of positive entries in the tile (TwELL's per-tile count), the positive
    entries as bits (words [C, NW], bit b of word k: column 32k + b), and the tile's active
    columns (one store per program)."""
    t = tl.program_id(0)
    cols = t * TILE_F + tl.arange(0, TILE_F)
    wcols = t * (TILE_F // 32) + tl.arange(0, TILE_F // 32)
    seen = tl.zeros([BLOCK_M, TILE_F], dtype=tl.int32)
    for i in range(ROW_BLOCKS):
        r = (tl.program_id(1) * ROW_BLOCKS + i) * BLOCK_M + tl.arange(0, BLOCK_M)
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
def _scatter_kernel(g_ptr, words_ptr, wpos_ptr, start_ptr, slot_ptr, ell_idx_ptr, ell_hg_ptr, bk_idx_ptr,
                    bk_hg_ptr, row0, C, N, F, W, BW, NW, BLOCK_M: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                    TILE_F: tl.constexpr, LISTS: tl.constexpr):
    """Hidden tile pid0, rows [pid1*ROW_BLOCKS*BLOCK_M, ...) of the chunk: the tile's positive
    entries, read as bits, at list positions start[tile, row] + their rank in the tile: the
    ELL buffer below W, the row's backup row from W on (fallback rows keep only their ELL
    part, which nothing reads). Work goes with the non-zeros, not the columns: a word's set
    bits are taken lowest first, one per step, for as many steps as the block's fullest word.
    Also the list position of each word's lowest column (wpos [C, NW], like words), for
    _union_up_kernel and _union_dh_kernel. LISTS False: wpos only (the backward by blocks)."""
    t = tl.program_id(0)
    wk = tl.arange(0, TILE_F // 32)
    wcols = t * (TILE_F // 32) + wk
    for i in range(ROW_BLOCKS):
        r = (tl.program_id(1) * ROW_BLOCKS + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = r < C
        r64 = r.to(tl.int64)
        w = tl.load(words_ptr + r64[:, None] * NW + wcols[None, :], mask=rmask[:, None], other=0)
        cnt = _popc(w)
        grow = r64 + row0
        first = tl.load(start_ptr + grow + (tl.zeros_like(grow) + t) * N, mask=rmask, other=0)
        slot = first[:, None] + tl.cumsum(cnt, axis=1) - cnt  # list position of each word's lowest bit
        tl.store(wpos_ptr + r64[:, None] * NW + wcols[None, :], slot, mask=rmask[:, None])
        if LISTS:
            bslot = tl.load(slot_ptr + grow, mask=rmask, other=-1)
            bk_row = tl.maximum(bslot, 0).to(tl.int64)[:, None] * BW
            for _ in range(0, tl.max(tl.max(cnt, axis=1), axis=0)):
                live = w != 0
                col = t * TILE_F + wk[None, :] * 32 + _popc((w & (0 - w)) - 1)
                hg = tl.load(g_ptr + r64[:, None] * F + col, mask=live, other=0.0)
                in_ell = live & (slot < W)
                tl.store(ell_idx_ptr + grow[:, None] * W + slot, col, mask=in_ell)
                tl.store(ell_hg_ptr + grow[:, None] * W + slot, hg, mask=in_ell)
                in_bk = live & (slot >= W) & (bslot >= 0)[:, None]
                tl.store(bk_idx_ptr + bk_row + (slot - W), col, mask=in_bk)
                tl.store(bk_hg_ptr + bk_row + (slot - W), hg, mask=in_bk)
                w = w & (w - 1)
                slot += 1

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
def _long_list_elsewhere(count, wide_rows, long_list, WIDE: tl.constexpr):
    """Whether this program's row (the pid0-th in count order, `count` non-zeros) is left to the
    other launch: lists over long_list among the first wide_rows go to the wide launch."""
    is_long = (count > long_list) & (tl.program_id(0) < wide_rows)
    if WIDE:
        return is_long == 0
    return is_long

@triton.jit
def _sddmm_kernel(a_ptr, w_ptr, order_ptr, start_ptr, slot_ptr, ell_idx_ptr, ell_hg_ptr, ell_u_ptr,
                  bk_idx_ptr, bk_hg_ptr, bk_u_ptr, l1_ptr, l1_scale_ptr, h_ptr, dhug_ptr, dell_u_ptr,
                  dell_g_ptr, dbk_u_ptr, dbk_g_ptr, row0, N, D, F, W, BW, NT, TPS, S, wide_rows, long_list,
                  WIDE: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token row0 + order[pid0], the list positions in hidden slice pid1 (tiles [pid1*TPS, ...)):
    acc = a_m . w[n] (fp32 sums over BLOCK_D columns a step). Forward (a=x, w=Wu): store
    u = acc in the format and the slice's sum |round(relu(g) u)| at l1[pid0, pid1]. Backward
    (a=dy, w=Wd^T): _dh_epilogue with dh = acc. Fallback rows have no list.
    _long_list_elsewhere says which launch takes a row."""
    r = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
    sl = tl.program_id(1)
    m = r + row0
    slot = tl.load(slot_ptr + m)
    t0 = sl * TPS
    t1 = tl.minimum(t0 + TPS, NT)
    p0 = tl.load(start_ptr + m + (m * 0 + t0) * N)
    elsewhere = _long_list_elsewhere(tl.load(start_ptr + m + (m * 0 + NT) * N), wide_rows, long_list, WIDE)
    p1 = tl.where((slot == -2) | elsewhere, p0, tl.load(start_ptr + m + (m * 0 + t1) * N))
    dtype = a_ptr.dtype.element_ty
    l1 = tl.zeros([BLOCK_S], dtype=tl.float32)
    for q0 in range(p0, p1, BLOCK_S):
        p = q0 + tl.arange(0, BLOCK_S)
        mp = p < p1
        in_ell, ell_off, in_bk, bk_off = _list_masks(m, p, mp, slot, W, BW)
        n64 = _list_load(ell_idx_ptr, bk_idx_ptr, in_ell, ell_off, in_bk, bk_off).to(tl.int64)
        hg = _list_load(ell_hg_ptr, bk_hg_ptr, in_ell, ell_off, in_bk, bk_off).to(tl.float32)
        acc2 = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)  # one reduction per list block
        for k0 in range(0, D, BLOCK_D):
            k = k0 + tl.arange(0, BLOCK_D)
            mk = k < D
            a = tl.load(a_ptr + m * D + k, mask=mk, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + n64[:, None] * D + k[None, :], mask=mp[:, None] & mk[None, :],
                        other=0.0).to(tl.float32)
            acc2 += w * a[None, :]
        acc = tl.sum(acc2, axis=1)
        if BACKWARD:
            u = _list_load(ell_u_ptr, bk_u_ptr, in_ell, ell_off, in_bk, bk_off).to(tl.float32)
            _dh_epilogue(acc, hg, u, tl.load(l1_scale_ptr), r, n64, mp, in_ell, ell_off, in_bk, bk_off,
                         h_ptr, dhug_ptr, dell_u_ptr, dell_g_ptr, dbk_u_ptr, dbk_g_ptr, F)
        else:
            u = acc.to(dtype)
            tl.store(ell_u_ptr + ell_off, u, mask=in_ell)
            tl.store(bk_u_ptr + bk_off, u, mask=in_bk)
            l1 += tl.abs((hg * u.to(tl.float32)).to(dtype).to(tl.float32))
    if not BACKWARD:
        tl.store(l1_ptr + tl.program_id(0).to(tl.int64) * S + sl + tl.arange(0, 1),
                 tl.zeros([1], dtype=tl.float32) + tl.sum(l1, axis=0))

@triton.jit
def _dh_values(dh_y, hg, u, l1_scale, dtype):
    """From relu(g), u and dh_y = (dy Wd)[n] (fp32): h, dh_u = dh relu(g), dh_g = dh u in dtype,
    with dh = dh_y + the L1 term, each rounded as the dense path rounds."""
    h = (hg * u).to(dtype).to(tl.float32)
    sign = tl.where(h > 0, 1.0, tl.where(h < 0, -1.0, 0.0))
    dh = (dh_y.to(dtype).to(tl.float32) + l1_scale * sign).to(dtype).to(tl.float32)
    return h.to(dtype), (dh * hg).to(dtype), (dh * u).to(dtype)

@triton.jit
def _dh_epilogue(dh_y, hg, u, l1_scale, r, n64, mp, in_ell, ell_off, in_bk, bk_off,
                 h_ptr, dhug_ptr, dell_u_ptr, dell_g_ptr, dbk_u_ptr, dbk_g_ptr, F):
    """At list positions with values relu(g), u and dh_y = (dy Wd)[n] (fp32): dh = dh_y + the L1
    term, dh_u = dh relu(g), dh_g = dh u, each rounded as the dense path rounds. h, dh_u, dh_g
    go into the chunk's dense rows r at columns n (for the weight-gradient GEMMs), dh_u and dh_g
    also to the list positions (for the dx SpMM)."""
    h, dhu, dhg = _dh_values(dh_y, hg, u, l1_scale, h_ptr.dtype.element_ty)
    tl.store(h_ptr + r * F + n64, h, mask=mp)
    tl.store(dhug_ptr + r * 2 * F + n64, dhu, mask=mp)
    tl.store(dhug_ptr + r * 2 * F + F + n64, dhg, mask=mp)
    tl.store(dell_u_ptr + ell_off, dhu, mask=in_ell)
    tl.store(dell_g_ptr + ell_off, dhg, mask=in_ell)
    tl.store(dbk_u_ptr + bk_off, dhu, mask=in_bk)
    tl.store(dbk_g_ptr + bk_off, dhg, mask=in_bk)

@triton.jit
def _spmm_kernel(w1_ptr, w2_ptr, order_ptr, count_ptr, slot_ptr, ell_idx_ptr, ell_a_ptr, ell_b_ptr,
                 bk_idx_ptr, bk_a_ptr, bk_b_ptr, out_ptr, row0, D, W, BW, wide_rows, long_list,
                 WIDE: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token row0 + order[pid0], d_model columns [pid1*BLOCK_D, ...): out = sum over the token's
    list of a, b (values at the list positions, format layout). Forward: a, b = relu(g), u and
    out = sum round(a b) w1[n], w1 = Wd^T. Backward: a, b = dh_u, dh_g and
    out = sum a w1[n] + b w2[n], w1, w2 = Wu, Wg. Fallback rows are left to the fallback kernels,
    and a row that _long_list_elsewhere gives to the other launch to that launch."""
    r = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
    m = r + row0
    slot = tl.load(slot_ptr + m)
    num = tl.load(count_ptr + m)
    skip = (slot == -2) | _long_list_elsewhere(num, wide_rows, long_list, WIDE)
    num = tl.where(skip, 0, num)
    dtype = out_ptr.dtype.element_ty
    k = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mk = k < D
    acc2 = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)  # reduced over the list once, at the end
    for q0 in range(0, num, BLOCK_S):
        p = q0 + tl.arange(0, BLOCK_S)
        mp = p < num
        in_ell, ell_off, in_bk, bk_off = _list_masks(m, p, mp, slot, W, BW)
        n64 = _list_load(ell_idx_ptr, bk_idx_ptr, in_ell, ell_off, in_bk, bk_off).to(tl.int64)
        m2 = mp[:, None] & mk[None, :]
        w1 = tl.load(w1_ptr + n64[:, None] * D + k[None, :], mask=m2, other=0.0).to(tl.float32)
        a = _list_load(ell_a_ptr, bk_a_ptr, in_ell, ell_off, in_bk, bk_off).to(tl.float32)
        b = _list_load(ell_b_ptr, bk_b_ptr, in_ell, ell_off, in_bk, bk_off).to(tl.float32)
        if BACKWARD:
            w2 = tl.load(w2_ptr + n64[:, None] * D + k[None, :], mask=m2, other=0.0).to(tl.float32)
            acc2 += w1 * a[:, None] + w2 * b[:, None]
        else:
            acc2 += w1 * (a * b).to(dtype).to(tl.float32)[:, None]
    keep = (tl.zeros_like(k) + skip.to(tl.int32)) == 0
    tl.store(out_ptr + m * D + k, tl.sum(acc2, axis=0).to(dtype), mask=mk & keep)

@triton.jit
def _dh_kernel(dh_ptr, count_ptr, slot_ptr, ell_idx_ptr, ell_hg_ptr, ell_u_ptr, bk_idx_ptr, bk_hg_ptr, bk_u_ptr,
               l1_scale_ptr, h_ptr, dhug_ptr, dell_u_ptr, dell_g_ptr, dbk_u_ptr, dbk_g_ptr, row0, F, W, BW,
               BLOCK: tl.constexpr):
    """Chunk row pid, at its list positions: dh = the chunk's dense dy Wd read at n, + the L1
    term; dh_u = dh relu(g), dh_g = dh u. h, dh_u, dh_g go into the chunk's dense rows (for
    the weight-gradient GEMMs), dh_u and dh_g also to the list positions (for the dx SpMM).
    Fallback rows have no list: _fallback_bwd_kernel does theirs."""
    r = tl.program_id(0).to(tl.int64)
    m = r + row0
    slot = tl.load(slot_ptr + m)
    num = tl.where(slot == -2, 0, tl.load(count_ptr + m))
    l1_scale = tl.load(l1_scale_ptr)
    for q0 in range(0, num, BLOCK):
        p = q0 + tl.arange(0, BLOCK)
        mp = p < num
        in_ell, ell_off, in_bk, bk_off = _list_masks(m, p, mp, slot, W, BW)
        n64 = _list_load(ell_idx_ptr, bk_idx_ptr, in_ell, ell_off, in_bk, bk_off).to(tl.int64)
        hg = _list_load(ell_hg_ptr, bk_hg_ptr, in_ell, ell_off, in_bk, bk_off).to(tl.float32)
        u = _list_load(ell_u_ptr, bk_u_ptr, in_ell, ell_off, in_bk, bk_off).to(tl.float32)
        dh_y = tl.load(dh_ptr + r * F + n64, mask=mp, other=0.0).to(tl.float32)
        _dh_epilogue(dh_y, hg, u, l1_scale, r, n64, mp, in_ell, ell_off, in_bk, bk_off,
                     h_ptr, dhug_ptr, dell_u_ptr, dell_g_ptr, dbk_u_ptr, dbk_g_ptr, F)

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
def _fallback_fwd_kernel(x_ptr, wu_ptr, wdt_ptr, g_ptr, slot_ptr, y_ptr, l1_ptr, row0, C, D, F,
                         ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Chunk rows [pid*ROWS, ...), for each fallback row among them: every hidden column of its
    gate (read from the chunk's gate g), u = x . Wu[n], h = relu(g) u, y = sum h Wd^T[n], and
    its sum |h|. (A program per row would cost a launch of N programs for the rare row.)"""
    for i in range(ROWS):
        _fallback_fwd_row(x_ptr, wu_ptr, wdt_ptr, g_ptr, slot_ptr, y_ptr, l1_ptr, row0,
                          (tl.program_id(0) * ROWS + i).to(tl.int64), C, D, F, BLOCK_S, BLOCK_D)

@triton.jit
def _fallback_row_slot(slot_ptr, m, r, C):
    """The row's slot, or -1 (not a fallback row) past the chunk's end r >= C."""
    return tl.where(r < C, tl.load(slot_ptr + tl.minimum(m, m - r + C - 1)), -1)

@triton.jit
def _fallback_fwd_row(x_ptr, wu_ptr, wdt_ptr, g_ptr, slot_ptr, y_ptr, l1_ptr, row0, r, C, D, F,
                      BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    m = row0 + r
    slot = _fallback_row_slot(slot_ptr, m, r, C)
    num = tl.where(slot == -2, F, 0)
    dtype = x_ptr.dtype.element_ty
    k = tl.arange(0, BLOCK_D)
    fb_k = (tl.zeros_like(k) + slot) == -2  # block masks: the interpreter wants them
    mk = (k < D) & fb_k
    xk = tl.load(x_ptr + m * D + k, mask=mk, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    l1 = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, num, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        hg = tl.maximum(tl.load(g_ptr + r * F + s, mask=s < num, other=0.0).to(tl.float32), 0.0)
        m2 = ((s < num) & (hg > 0))[:, None] & mk[None, :]
        w_u = tl.load(wu_ptr + s[:, None].to(tl.int64) * D + k[None, :], mask=m2, other=0.0).to(tl.float32)
        w_d = tl.load(wdt_ptr + s[:, None].to(tl.int64) * D + k[None, :], mask=m2, other=0.0).to(tl.float32)
        u = tl.sum(w_u * xk[None, :], axis=1).to(dtype)
        h = (hg * u.to(tl.float32)).to(dtype).to(tl.float32)
        l1 += tl.abs(h)
        acc += tl.sum(w_d * h[:, None], axis=0)
    tl.store(y_ptr + m * D + k, acc.to(dtype), mask=mk)
    tl.store(l1_ptr + m + tl.arange(0, 1), tl.zeros([1], dtype=tl.float32) + tl.sum(l1, axis=0),
             mask=(tl.zeros([1], dtype=tl.int32) + slot) == -2)

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
    product's M is BN: Hopper's wgmma needs M >= 64, and the block's BM is 16 (as a w^T, M = 16,
    Triton takes mma.sync; on the H200, real layers at 99%, the up kernel took 3.04-3.33 ms that
    way against 2.75-3.00, and dh 3.67-3.96 against 3.42-3.71: RESULTS.md, 2026-11-30). The down
    kernels transposed the same way (M = the d_model slice) were slower: dx 11.8 against 7.4 ms."""
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
def _union_up_kernel(x_ptr, wu_ptr, g_ptr, words_ptr, wpos_ptr, slot_ptr, ucnt_ptr, ucols_ptr, ell_idx_ptr,
                     ell_hg_ptr, ell_u_ptr, bk_idx_ptr, bk_hg_ptr, bk_u_ptr, h_ptr, l1_ptr, row0, C, D, F, NW, W,
                     BW, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                     OFF64: tl.constexpr, UPCAST: tl.constexpr):
    """Token block pid1, its union columns [j*BN, ...) for j = pid0, pid0 + SPLIT, ...: u = x W_up^T
    on the tensor cores over every (row, column) pair of the block, the rows' weights shared. At
    the pairs whose gate is positive: h = round(relu(g) u) into h's row at the union position
    (zero elsewhere, for _union_down_kernel), the column, relu(g) and u into the row's list
    (position from wpos and the word's lower bits; fallback rows keep no list); the program's sum
    |h| at l1[pid1, pid0]. OFF64: chunk offsets r * F need 64 bits."""
    b = tl.program_id(1)
    n_u, r, mr, m, r_f = _block_rows(ucnt_ptr, b, row0, C, F, BM, OFF64)
    slot = tl.load(slot_ptr + m, mask=mr, other=-2)
    dtype = x_ptr.dtype.element_ty
    l1 = tl.zeros([BM], dtype=tl.float32)
    for j in range(tl.program_id(0), tl.cdiv(n_u, BN), SPLIT):
        q = j * BN + tl.arange(0, BN)
        mq = q < n_u
        cols = tl.load(ucols_ptr + b * F + q, mask=mq, other=0)
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
    tl.store(l1_ptr + b * SPLIT + tl.program_id(0) + tl.arange(0, 1),
             tl.zeros([1], dtype=tl.float32) + tl.sum(l1, axis=0))

@triton.jit
def _union_dh_kernel(dy_ptr, wdt_ptr, words_ptr, wpos_ptr, slot_ptr, ucnt_ptr, ucols_ptr, ell_hg_ptr, ell_u_ptr,
                     bk_hg_ptr, bk_u_ptr, l1_scale_ptr, h_ptr, dhug_ptr, dhu_ptr, dhg_ptr, row0, C, D, F, NW, W,
                     BW, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                     OFF64: tl.constexpr, UPCAST: tl.constexpr):
    """The backward's _union_up_kernel: token block pid1, union columns [j*BN, ...) for
    j = pid0, pid0 + SPLIT, ...: dh_y = dy W_down over every (row, column) pair of the block,
    then, at the pairs in the rows' lists (relu(g) and u read there), h, dh_u and dh_g as
    _dh_values gives them: into the chunk's dense rows at the columns (for the weight-gradient
    GEMMs) and at the union positions (zero elsewhere, for the dx product by blocks). Fallback
    rows are left to _fallback_bwd_kernel. OFF64: dense offsets r * 2F need 64 bits."""
    b = tl.program_id(1)
    n_u, r, mr, m, r_f = _block_rows(ucnt_ptr, b, row0, C, F, BM, OFF64)
    slot = tl.load(slot_ptr + m, mask=mr, other=-2)
    l1_scale = tl.load(l1_scale_ptr)
    dtype = dy_ptr.dtype.element_ty
    for j in range(tl.program_id(0), tl.cdiv(n_u, BN), SPLIT):
        q = j * BN + tl.arange(0, BN)
        mq = q < n_u
        cols = tl.load(ucols_ptr + b * F + q, mask=mq, other=0)
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
                       SLICES_OUTER: tl.constexpr, OFF64: tl.constexpr, UPCAST: tl.constexpr):
    """Token block pid1, d_model columns [pid0*BD, ...) (SLICES_OUTER: the other way round, so all
    blocks pass over one slice of the weights before the next): out = a w over the block's union columns
    (a at the union positions, [C, F]; w's rows at the columns, [F, D]), the rows' weights
    shared. Forward: a = h as _union_up_kernel left it, w = W_down^T: y. TWO (the backward):
    + a2 w2, with a, a2 = dh_u, dh_g from _union_dh_kernel and w, w2 = W_up, W_gate: dx, except
    at fallback rows (_fallback_bwd_kernel's)."""
    if SLICES_OUTER:
        b, ds = tl.program_id(0), tl.program_id(1)
    else:
        b, ds = tl.program_id(1), tl.program_id(0)
    n_u, _, mr, m, r_f = _block_rows(ucnt_ptr, b, row0, C, F, BM, OFF64)
    k = ds * BD + tl.arange(0, BD)
    mk = k < D
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for q0 in range(0, n_u, BK):
        q = q0 + tl.arange(0, BK)
        mq = q < n_u
        cols = tl.load(ucols_ptr + b * F + q, mask=mq, other=0).to(tl.int64)
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
