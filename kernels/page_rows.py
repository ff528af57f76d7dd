"""Rows of a page pool copied by an index: the gathers and scatters of offloaded sparse pages
(student/long_context/store.py: a chunk's selected pages and their gradient rows).

``gather_rows(pool, index)`` -> [n, *row]: out[i] = pool[index[i]], zeros where index[i] < 0 (a
gradient row just taken, nothing added to it yet), on index's device.
``scatter_rows(pool, index, src)``: pool[index[i]] = src[i] (indices distinct).

Paths: "torch", the reference and the path where pool and index share a device: index_select and
index_copy_; across devices it moves the index to the pool and the rows between them, which
waits for the device. "triton" (kernels/page_rows_triton.py): pool in pinned host memory (or on
the GPU), index and the other operand on the GPU: the GPU reads or writes the pool's rows through
unified addressing, so a gather from the host needs no host copy and no wait, and is ordered on
the stream after the copies that wrote the pool. "auto": triton for a pinned host pool and a
CUDA index, else torch. Both copy bits: the paths agree exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None

if triton is not None:
    from kernels.page_rows_triton import _gather_kernel, _scatter_kernel

__all__ = ["RowCopySettings", "gather_rows", "scatter_rows"]

IMPLS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class RowCopySettings:
    """How the Triton path runs: elements a program copies, warps a program."""

    block: int = 4096
    num_warps: int = 8


def gather_rows(pool: torch.Tensor, index: torch.Tensor, *, impl: str = "auto",
                settings: RowCopySettings = RowCopySettings()) -> torch.Tensor:
    """[n, *pool.shape[1:]] on index's device: pool[index], zeros where index < 0 (module docstring)."""
    if _path(pool, index, impl) == "torch":
        at = index.to(pool.device)
        out = pool.index_select(0, at.clamp(min=0))
        out.masked_fill_((at < 0).view(-1, *[1] * (out.dim() - 1)), 0)  # no boolean indexing: no device sync
        return out.to(index.device, non_blocking=True)
    out = torch.empty((index.numel(), *pool.shape[1:]), dtype=pool.dtype, device=index.device)
    n = out[0].numel() if index.numel() else 0
    if n:
        _gather_kernel[(index.numel(), triton.cdiv(n, settings.block))](
            pool, index.contiguous(), out, n, BLOCK=settings.block, num_warps=settings.num_warps)
    return out


def scatter_rows(pool: torch.Tensor, index: torch.Tensor, src: torch.Tensor, *, impl: str = "auto",
                 settings: RowCopySettings = RowCopySettings()) -> None:
    """pool[index[i]] = src[i] for distinct indices >= 0 (module docstring)."""
    if src.shape != (index.numel(), *pool.shape[1:]) or src.dtype != pool.dtype:
        raise ValueError(f"src must be {pool.dtype} [{index.numel()}, {', '.join(map(str, pool.shape[1:]))}] "
                         f"for {index.numel()} indices, got {src.dtype} {list(src.shape)}")
    if _path(pool, index, impl) == "torch":
        pool.index_copy_(0, index.to(pool.device), src.to(pool.device))
        return
    n = src[0].numel() if index.numel() else 0
    if n:
        _scatter_kernel[(index.numel(), triton.cdiv(n, settings.block))](
            pool, index.contiguous(), src.contiguous(), n, BLOCK=settings.block, num_warps=settings.num_warps)


def _path(pool: torch.Tensor, index: torch.Tensor, impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if index.dim() != 1 or index.dtype != torch.long:
        raise ValueError(f"index must be a 1-d int64 tensor, got {index.dtype} of shape {list(index.shape)}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous (rows of pool.shape[1:] one after another)")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    host_pool = pool.device.type == "cpu" and index.is_cuda and pool.is_pinned()
    if impl == "triton":
        if triton is None or not (index.is_cuda or interpreted) or not (pool.is_cuda or host_pool or interpreted):
            raise ValueError(f"impl='triton' needs Triton, a CUDA index and a pool on the GPU or in pinned host "
                             f"memory (or TRITON_INTERPRET=1), got pool on {pool.device}, index on "
                             f"{index.device}; use impl='auto' or 'torch'")
        return "triton"
    return "triton" if impl == "auto" and triton is not None and host_pool else "torch"
