"""The host heap of a training process: freed pieces kept for the next piece.

The optimizers' CPU steps (kernels/adamw8bit_step.py, kernels/foam_step.py) update a layer in pieces of
about a megabyte so that each piece's temporaries come from the allocator's free lists instead of fresh
pages. glibc's malloc, as it starts, does not do that reliably: a block over its mmap threshold (128 KiB
at first, raised as such blocks are freed) is mapped and unmapped each time, and free memory at the top
of a heap over its trim threshold (twice the mmap threshold) goes back to the system. Whether a fresh
process reuses the pieces' pages or faults every one in again on every update depends on which blocks
it happened to free first, and the process that faults runs the update several times slower
(notes/long-context.md, "The CPU update's pages"). Fixing both thresholds puts every process on the
path that reuses them.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_pieces"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_pieces(mmap_threshold: int = 32 << 20, trim_threshold: int = 64 << 20) -> bool:
    """Have glibc's malloc serve blocks under `mmap_threshold` bytes from its heaps (32 MiB is its
    largest) and keep up to `trim_threshold` bytes free at a heap's top instead of returning them, for
    this whole process. The cost: each heap (one per thread that allocates, at most 8 a core) may keep
    up to `trim_threshold` freed bytes. Returns whether both were set (False where the C library is
    not glibc: nothing changes there)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
