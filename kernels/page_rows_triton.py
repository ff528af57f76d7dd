"""Triton kernels of kernels/page_rows.py (imports nothing of ours): rows of a pool copied by an
index, either way. The pool may be pinned host memory: the GPU then reads or writes it over the bus
itself (unified addressing), in stream order, with no copy on the host."""

import triton
import triton.language as tl


@triton.jit
def _gather_kernel(pool_ptr, index_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """out[i, block] = pool[index[i], block], zeros where index[i] < 0; rows of N elements."""
    i, pid = tl.program_id(0), tl.program_id(1)
    rows = tl.zeros([BLOCK], tl.int64) + tl.load(index_ptr + i)  # the row, for every element
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(pool_ptr + rows * N + offs, mask=inside & (rows >= 0), other=0.0)
    tl.store(out_ptr + i.to(tl.int64) * N + offs, x, mask=inside)


@triton.jit
def _scatter_kernel(pool_ptr, index_ptr, src_ptr, N, BLOCK: tl.constexpr):
    """pool[index[i], block] = src[i, block]; rows of N elements."""
    i, pid = tl.program_id(0), tl.program_id(1)
    row = tl.load(index_ptr + i).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(src_ptr + i.to(tl.int64) * N + offs, mask=inside)
    tl.store(pool_ptr + row * N + offs, x, mask=inside)
