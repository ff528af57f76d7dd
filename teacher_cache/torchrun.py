"""The ranks of a stage-one build launched by ``torchrun``: joining its ``torch.distributed``
process group, and the ``Collective`` through which the ranks agree (``teacher_cache.workers``).

Imported only on the torchrun path (``pipelines.stage_one``), which runs a teacher and needs torch
anyway; ``teacher_cache.workers`` stays torch-free.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from teacher_cache.workers import Collective


class TorchCollective(Collective):
    """The ranks of the default ``torch.distributed`` process group."""

    def __init__(self):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def barrier(self) -> None:
        dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


def init_torchrun(device: str) -> bool:
    """Join torchrun's process group (nccl when the teacher runs on CUDA, on ``device``, else
    gloo) unless one is open already; returns whether this call opened it (so its caller closes it
    with ``leave_torchrun``)."""
    if dist.is_initialized():
        return False
    device_type = torch.device(device).type
    if device_type == "cuda":
        torch.cuda.set_device(torch.device(device))  # nccl's objects go through the rank's own GPU
    # Ranks wait at the first barrier while rank 0 checks every shard of an existing cache, and
    # at the last while the slowest rank finishes its shards: far longer than a training step.
    timeout = datetime.timedelta(hours=12)
    dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", timeout=timeout)
    return True


def leave_torchrun() -> None:
    """Close the process group that ``init_torchrun`` opened."""
    dist.destroy_process_group()
