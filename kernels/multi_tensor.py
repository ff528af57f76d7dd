"""Multi-tensor launch tables: one Triton launch updates many tensors of an optimizer step.

An optimizer step touches hundreds of tensors, most of them small; a launch per tensor spends the
step in launch overhead. So one launch covers every tensor that shares the kernel's compile-time
arguments (dtypes, block, alignment), addressed through tables on the device:

- ``meta`` int64 [k, META_COLUMNS]: per tensor, the columns the kernel defines (the addresses of
  the param and its state, sizes), and in the last column the launch-wide index of the tensor's
  first tile (``TensorTable``);
- ``tile_owner`` int32 [num_tiles]: the tensor each program updates;
- the grads' addresses, int64 [k], in a table of their own (``GradTable``): a backward may put the
  grads at new addresses every step, and then these k addresses are all that is uploaded again.

Tables go up through pinned memory without a host sync, so a step built on them syncs nothing.
The FOAM step (kernels/foam_step.py) and the 8-bit AdamW step (kernels/adamw8bit_step.py) share
this module: the tables, the alignment test, and the Triton helpers that turn a table entry into
a typed pointer and round fp32 to bf16.
"""

from __future__ import annotations

import math
import os
from numbers import Real

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch paths need no Triton
    triton = None

__all__ = ["META_COLUMNS", "TRITON_DTYPE_NAMES", "GradTable", "TensorTable", "check_number", "check_step",
           "is_aligned", "is_power_of_two", "runs_triton", "triton_can_run", "upload"]

# The dtypes a multi-tensor kernel takes, by the name its DTYPE constexpr uses (see as_pointer).
TRITON_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
META_COLUMNS = 8  # per tensor: up to 7 kernel columns, then the first tile


def triton_can_run(device: torch.device) -> bool:
    """Whether a Triton kernel can run on ``device``: a CUDA device, or any device under Triton's
    CPU interpreter (TRITON_INTERPRET=1 set before the kernels were defined; tests use it)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def runs_triton(impl: str, tensors) -> bool:
    """Whether a step with ``impl`` runs its Triton kernel on ``tensors`` (params and grads): "torch"
    never; "auto" for CUDA tensors of the kernel's dtypes when Triton is installed; "triton" always,
    or a ValueError saying why it cannot."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"`impl` must be 'auto', 'triton' or 'torch', got {impl!r}")
    kernel_dtypes = all(t.dtype in TRITON_DTYPE_NAMES for t in tensors)
    devices = {t.device for t in tensors}
    if impl == "torch":
        return False
    if impl == "auto":
        return triton is not None and kernel_dtypes and all(d.type == "cuda" for d in devices)
    if not kernel_dtypes:
        raise ValueError("impl='triton' takes fp32, bf16 or fp16 params and grads; use impl='auto' or 'torch'")
    if not all(triton_can_run(d) for d in devices):
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import) and the "
                         f"triton package, got {sorted(map(str, devices))}; use impl='auto' or 'torch'")
    return True


def is_power_of_two(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1 and value & (value - 1) == 0


def check_number(name: str, value, low: float, high: float = math.inf, low_inclusive: bool = True) -> None:
    """ValueError unless ``value`` is a finite real in [low, high) (or (low, high))."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= low if low_inclusive else value > low) and value < high
    if not ok:
        raise ValueError(f"`{name}` must be a finite number in {'[' if low_inclusive else '('}{low}, {high}), "
                         f"got {value!r}")


def check_step(step) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"`step` must be an int >= 1 (the count including this step), got {step!r}")


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list (or CPU tensor) as a device tensor without a host sync (pinned staging on
    CUDA; the caching host allocator keeps the staging buffer until the copy has run)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def is_aligned(tensors, align_bytes: int) -> bool:
    """Whether every tensor's address is a multiple of ``align_bytes`` (the launch then tells the
    compiler so, and the loads become vector loads)."""
    return all(t.data_ptr() % align_bytes == 0 for t in tensors)


class TensorTable:
    """The device tables of one launch over k tensors.

    columns: per tensor, at most META_COLUMNS - 1 ints the kernel reads (``tl.load(row + i)``);
    num_tiles: per tensor, the programs it takes. ``locate_tile`` gives a program its tensor's row
    and its tile index within that tensor."""

    def __init__(self, columns: list[list[int]], num_tiles: list[int], device: torch.device):
        assert len(columns) == len(num_tiles) and all(len(c) < META_COLUMNS for c in columns)
        meta, owners, first_tile = [], [], 0
        for index, (cols, tiles) in enumerate(zip(columns, num_tiles)):
            meta += list(cols) + [0] * (META_COLUMNS - 1 - len(cols)) + [first_tile]
            owners += [index] * tiles
            first_tile += tiles
        self.num_tensors = len(columns)
        self.num_tiles = first_tile  # the launch's grid; 0 when every tensor is empty
        self.meta = upload(meta, torch.int64, device).view(-1, META_COLUMNS)
        self.tile_owner = upload(owners, torch.int32, device)


class GradTable:
    """The grads' addresses for a sequence of launches, one int64 table on the device, uploaded again
    only when the grads move (a backward after ``zero_grad(set_to_none=True)`` often reuses them).

    launches: objects with ``num_tensors``, ``grad_dtype`` and ``aligned``, in the order their grads
    are passed to ``point_at``; ``for_launch(i)`` is launch i's slice of the table."""

    def __init__(self, launches, align_bytes: int):
        self.align_bytes = align_bytes
        self.planned = [(launch.grad_dtype, launch.aligned) for launch in launches for _ in range(launch.num_tensors)]
        self.offsets, start = [], 0
        for launch in launches:
            self.offsets.append((start, start + launch.num_tensors))
            start += launch.num_tensors
        self.addresses: list[int] | None = None
        self.dtypes: list[torch.dtype] | None = None
        self.table: torch.Tensor | None = None

    def point_at(self, grads: list[torch.Tensor]) -> bool:
        """Make the table hold these grads' addresses; False when a grad no longer fits its planned
        launch (another dtype, not contiguous, or misaligned where the launch assumes alignment),
        and the caller must plan the launches again."""
        addresses = [g.data_ptr() for g in grads]
        dtypes = [g.dtype for g in grads]
        if addresses == self.addresses and dtypes == self.dtypes:
            return True
        fits = all(g.dtype == dtype and g.is_contiguous() and (not aligned or address % self.align_bytes == 0)
                   for g, address, (dtype, aligned) in zip(grads, addresses, self.planned))
        if not fits:
            return False
        self.addresses, self.dtypes = addresses, dtypes
        self.table = upload(addresses, torch.int64, grads[0].device)
        return True

    def for_launch(self, index: int) -> torch.Tensor:
        start, stop = self.offsets[index]
        return self.table[start:stop]


if triton is not None:
    _COLUMNS = tl.constexpr(META_COLUMNS)

    @triton.jit
    def locate_tile(meta_ptr, tile_owner_ptr):
        """(owner, row, tile) of this program: the index of its tensor in the launch, a pointer to
        that tensor's meta row, and the program's tile within the tensor."""
        pid = tl.program_id(0)
        owner = tl.load(tile_owner_ptr + pid).to(tl.int64)
        row = meta_ptr + owner * _COLUMNS
        return owner, row, pid - tl.load(row + _COLUMNS - 1)

    @triton.jit
    def as_pointer(address, DTYPE: tl.constexpr):
        """An int64 address from a table as a pointer to DTYPE: "fp32", "bf16", "fp16" or "u8"."""
        if DTYPE == "bf16":
            ptr = address.to(tl.pointer_type(tl.bfloat16))
        elif DTYPE == "fp16":
            ptr = address.to(tl.pointer_type(tl.float16))
        elif DTYPE == "u8":
            ptr = address.to(tl.pointer_type(tl.uint8))
        else:
            ptr = address.to(tl.pointer_type(tl.float32))
        return ptr

    @triton.jit
    def to_bf16_rtne(x):
        """fp32 -> bf16 rounded to nearest even, NaN kept, by bit arithmetic: the same on a GPU and
        in Triton's interpreter, whose own cast truncates (a bf16 param would drift an ulp a step)."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x != x, 0x7FC0, bits)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
