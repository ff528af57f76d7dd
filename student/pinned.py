"""Page-locked host memory for the large, long-lived buffers of offloaded training, exactly as large
as asked.

torch's pinned allocator (`torch.empty(..., pin_memory=True)`) rounds every request up to a power of
two and keeps freed blocks cached by size until its cache is emptied. That suits the small buffers a
step makes and drops (a chunk's attention output, a page set's copy), not the large ones: a layer's
fp32 master and gradient (student/offload/update.py), the host embedding's (student/offload/
embedding.py) and the key/value store's page pools (student/long_context/store.py): rounded up,
they hold up to twice their bytes, and a step of another length (a priming step, the profile's)
leaves its sizes cached beside the new ones (notes/long-context.md, "The 7B on an H100 again").

host_empty / unpin: plain host memory page-locked in place (cudaHostRegister, as torch.cuda's own
    helper does), and its page-locking given back.
PinnedPools (`POOLS`): buffers handed out at their exact size and taken back when their owner is
    collected, kept page-locked for the next owner that asks for the same size and dtype (the next
    step's store). A request that none of them fits gives them all back first: it comes from a step
    of another length, whose sizes the old ones will not be asked for again. A kept buffer is handed
    out again only after the device has finished what was queued (its copies into and out of it).
release_cached(): both caches back to the system: POOLS' kept buffers, torch's pinned blocks.
"""

from __future__ import annotations

import math
import weakref

import torch

__all__ = ["host_empty", "unpin", "PinnedPools", "POOLS", "release_cached"]


def host_empty(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor of `shape` (an int or a tuple), page-locked in place when `pin`;
    `unpin` gives the page-locking back before the memory is freed."""
    tensor = torch.empty(shape, dtype=dtype)
    if pin and tensor.numel():
        error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0))
        if error:
            raise RuntimeError(f"page-locking {tensor.nbytes} bytes of host memory failed (cudaError {error}); "
                               "give the plan a smaller host budget (--host-memory)")
    return tensor


def unpin(tensor: torch.Tensor) -> None:
    error = int(torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()))
    assert not error, f"cudaHostUnregister of a buffer this process registered failed (cudaError {error})"


class PinnedPools:
    """Exact page-locked buffers by (elements, dtype), kept between their owners (module docstring).
    `pin` False: the same bookkeeping over plain host memory, without a device (for tests)."""

    def __init__(self, pin: bool = True):
        self.pin = pin
        self._kept: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._returned = False  # a buffer came back since the last device sync

    def empty(self, owner, shape, dtype: torch.dtype) -> torch.Tensor:
        """A page-locked host tensor of `shape` and `dtype`, uninitialised, taken back when `owner`
        (any object that takes a weak reference) is collected."""
        key = (math.prod(shape), dtype)
        kept = self._kept.get(key)
        if kept:
            self._settle()  # the last owner's copies may still be queued on the device
            flat = kept.pop()
        else:
            self.release()
            flat = host_empty(key[0], dtype, self.pin)
        weakref.finalize(owner, self._take_back, key, flat)
        return flat.view(shape)

    def _take_back(self, key, flat: torch.Tensor) -> None:
        self._kept.setdefault(key, []).append(flat)
        self._returned = True

    def kept_bytes(self) -> int:
        return sum(t.nbytes for kept in self._kept.values() for t in kept)

    def release(self) -> None:
        """The kept buffers' page-locking and memory back to the system."""
        kept, self._kept = self._kept, {}
        if kept:
            self._settle()
        for buffers in kept.values():
            for flat in buffers:
                if self.pin and flat.numel():
                    unpin(flat)

    def _settle(self) -> None:
        """Wait for the device once after buffers came back: copies into or out of them may be queued."""
        if self._returned and self.pin:
            torch.cuda.synchronize()
        self._returned = False


POOLS = PinnedPools()


def release_cached() -> None:
    """POOLS' kept buffers and torch's cached pinned blocks back to the system (the latter where this
    torch has `torch.accelerator.empty_host_cache`; the blocks it caches are a step's small
    buffers); nothing on a machine without CUDA."""
    if not torch.cuda.is_available():
        return
    POOLS.release()
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is not None:
        empty()
