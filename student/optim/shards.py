"""FOAM's and 8-bit AdamW's states for parameters FSDP2 shards (student/distributed.py).

Under FSDP2 a parameter is a DTensor sharded by rows (Shard(0) over a 1-D mesh of the ranks); its
local tensor holds this rank's rows and its gradient is a DTensor of the same layout. The
optimizers step on those local tensors (`local`), with states shaped for the local shard, and keep
each state as a DTensor sharded like its parameter (`like`), so that get_state_dict and
torch.distributed.checkpoint save every rank's part and read it back at the same or, where the
state's global shape does not depend on the world size, at any world size.

torch is imported at the top: only the optimizers import this module.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

__all__ = ["local", "local_rows", "like", "is_sharded", "largest_shard_numel"]


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor a step reads and writes: a DTensor's local shard (this rank's rows), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_rows(t: torch.Tensor) -> slice:
    """The rows of the whole `t` that its local shard holds (FSDP2 cuts rows as torch.chunk does);
    every row of a plain tensor."""
    if not is_sharded(t):
        return slice(None)
    _check_rows(t)
    per_rank = -(-t.shape[0] // t.device_mesh.size())
    start = min(t.device_mesh.get_local_rank() * per_rank, t.shape[0])
    return slice(start, start + t.to_local().shape[0])


def is_sharded(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor)


def _check_rows(p: DTensor) -> None:
    assert p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),), \
        f"FSDP2 shards parameters by rows over one mesh dimension, got {p.placements}"


def like(p: torch.Tensor, local_state: torch.Tensor, global_shape) -> torch.Tensor:
    """`local_state`, this rank's part of a state of parameter `p`: a DTensor of `global_shape`
    sharded by rows as `p` is when `p` is a DTensor (its first dimension must then split over the
    ranks as `p`'s rows do, or be ranks x the local length), else `local_state` itself."""
    if not is_sharded(p):
        return local_state
    _check_rows(p)
    global_shape = torch.Size(global_shape)
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(local_state, p.device_mesh, p.placements, run_check=False, shape=global_shape,
                              stride=stride)


def largest_shard_numel(p: torch.Tensor) -> int:
    """Elements of the largest rank's shard of `p` (rank 0's: FSDP2 cuts rows as torch.chunk does);
    `p.numel()` for a plain tensor."""
    if not is_sharded(p) or p.ndim == 0 or p.shape[0] == 0:
        return p.numel()
    _check_rows(p)
    rows = -(-p.shape[0] // p.device_mesh.size())
    return rows * (p.numel() // p.shape[0])
