"""The checkpoint folders of a stage-two run directory, found without torch: `distill runs`
(pipelines/experiments.py) lists runs from their files, and student/checkpoint.py, which writes and
reads the checkpoints, finds them here too.

  RUN/checkpoints/step-NNNNNN/  one checkpoint (student/checkpoint.py says what it holds)
"""

from __future__ import annotations

from pathlib import Path

from distill.errors import DistillUserError

__all__ = ["RunDirError", "checkpoints", "latest_checkpoint", "checkpoint_step"]


class RunDirError(DistillUserError):
    """The run directory holds another run, or a checkpoint of another model."""


def checkpoints(out) -> list[Path]:
    """The run's checkpoint folders, oldest first."""
    return sorted((Path(out) / "checkpoints").glob("step-[0-9]*"))


def latest_checkpoint(out) -> Path | None:
    found = checkpoints(out)
    return found[-1] if found else None


def checkpoint_step(ckpt: Path) -> int:
    return int(ckpt.name.removeprefix("step-"))
