"""The one small protocol every teacher backend implements."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from teacher_cache.targets import TeacherTargets


class TeacherBackend(Protocol):
    """Scores token sequences with a teacher and returns cache format v1 targets.

    Implementations: ``teacher_cache.backends.hf.HFBackend`` and
    ``teacher_cache.backends.vllm.VLLMBackend``.
    """

    name: str  # "hf" | "vllm"
    vocab_size: int  # rows of the lm-head (logits width)
    # A backend that sees the whole distribution sets ``can_sample = True`` and takes
    # ``sampling=`` (a ``teacher_cache.targets.Sampling``) and ``indices=`` (the sequences' indices
    # in the cache) in ``score`` and ``score_blocks``, returning sampled targets (the hf backend).

    def score(self, sequences: list[np.ndarray], k: int) -> list[TeacherTargets]:
        """sequences: int32 [L_i] token ids each; returns one TeacherTargets of L_i rows per sequence."""
        ...

    def describe(self) -> dict:
        """Teacher fields for the manifest: {"path", "weights_hash", "backend", "dtype"}."""
        ...

    def close(self) -> None:
        """Free the model (GPU memory, engine processes)."""
        ...
