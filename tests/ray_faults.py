"""Faults injected into stage one's Ray tasks through the ``wrap_teacher`` seam of
``pipelines.stage_one.cache_teacher`` (``ray_executor.RayCluster.teacher``).

Module-level, so Ray pickles them by reference and its workers import this module: tests/ must
be on the workers' PYTHONPATH (tests/test_ray_capture.py's local Ray puts it there).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

MODES = ("kill", "raise")


def fail_shard(shard: int, mode: str, marker: Path) -> functools.partial:
    """A ``wrap_teacher`` whose first attempt at shard ``shard`` (while the file ``marker`` does not
    exist; the attempt writes its worker's pid there) fails after handing the shard's first row
    block to the writer, so the shard is cut in the middle. mode "kill": SIGKILL the worker
    process, as the OOM killer or a lost node would (Ray retries the task); "raise": a RuntimeError
    in the task (a task error, which Ray does not retry)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return functools.partial(_wrap, shard=shard, mode=mode, marker=str(marker))


def _wrap(backend, index: int, *, shard: int, mode: str, marker: str):
    if index != shard or os.path.exists(marker):
        return backend
    Path(marker).write_text(str(os.getpid()))
    return FailingTeacher(backend, mode)


class FailingTeacher:
    """Fails when asked for the shard's second row block, once the first is handed on (so the
    shard needs two blocks: two sequences scored one at a time, or a chunked one)."""

    def __init__(self, backend, mode: str):
        self.backend, self.mode, self.blocks = backend, mode, 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def score_blocks(self, sequences, k, **options):
        for item in self.backend.score_blocks(sequences, k, **options):
            self.blocks += 1
            if self.blocks == 2:
                time.sleep(0.5)  # lets the writer thread start the shard's temp file
                if self.mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"the test's fault at this shard ({self.mode})")
            yield item
