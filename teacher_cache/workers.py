"""Which process writes which shard of a cache, and how the processes of one build agree.

The shard is the unit of work. Shard ``i`` belongs to worker ``i % num_workers`` (round robin):
deterministic (a function of the index and the number of workers only), disjoint and complete,
and balanced whatever the order of the corpus (the short last shard and any run of long sequences
spread over the workers instead of landing on the last one, as contiguous blocks would). A worker
skips its shards that are already written, whoever wrote them, so a build interrupted at one
number of workers resumes at another.

Three ways to run a build (``Workers``):
- one process: writes every shard, then the manifest;
- ``torchrun``: ranks of one ``torch.distributed`` group (``teacher_cache.torchrun``); rank 0
  claims the folder (and repairs a damaged cache) while the others wait at a barrier, every rank
  writes its shards, the ranks' shard records are gathered to rank 0 and rank 0 writes the
  manifest after a barrier;
- a job array (``--num-workers W --worker-index I``): workers that never talk to each other; each
  writes its shards and no complete manifest, and ``distill cache-merge`` (or one more run without
  the worker options) writes the manifest once every shard is there.

Torch-free: a one-process build, a job-array worker and ``distill cache-merge`` need no torch, and
the CLI imports the build's config through ``teacher_cache.build``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from distill.configs import require


def shard_owner(index: int, num_workers: int) -> int:
    """The worker that writes shard ``index`` of a build by ``num_workers`` workers."""
    return index % num_workers


def worker_shards(num_shards: int, num_workers: int, worker_index: int) -> list[int]:
    """The shards worker ``worker_index`` of ``num_workers`` writes, in increasing order."""
    return list(range(worker_index, num_shards, num_workers))


class Collective:
    """How the processes of one build agree; this one is the single process (nothing to agree)."""

    rank, world_size = 0, 1

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, in rank order, on rank 0 (None on the others)."""
        return [obj]


@dataclass(frozen=True)
class Workers:
    """This process's part of a build.

    num_workers / worker_index: the build's workers and this one (0-based). collective: how they
    agree; None for job-array workers, which do not talk to each other (so no manifest).
    """

    num_workers: int = 1
    worker_index: int = 0
    collective: Collective | None = Collective()

    def __post_init__(self) -> None:
        require("num_workers", self.num_workers, isinstance(self.num_workers, int) and self.num_workers >= 1,
                "an integer >= 1")
        require("worker_index", self.worker_index,
                isinstance(self.worker_index, int) and 0 <= self.worker_index < self.num_workers,
                f"an integer in [0, --num-workers={self.num_workers})")

    @property
    def leader(self) -> bool:
        """Claims the folder, repairs damage and writes the manifest (one process or rank 0)."""
        return self.collective is not None and self.worker_index == 0

    @property
    def single(self) -> bool:
        return self.num_workers == 1 and self.collective is not None

    def shards(self, num_shards: int) -> list[int]:
        return worker_shards(num_shards, self.num_workers, self.worker_index)


def torchrun_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun with more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0"))
