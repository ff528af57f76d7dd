"""The teacher of `distill eval --teacher`: an HF folder, checked against the cache being evaluated
and loaded beside the student, so student/evaluate.py can measure the exact full-vocabulary KL and
the calibration on the held-out rows.

Why here and why the student decoder: student/ may read caches but not open teachers (DESIGN.md),
and the checks need stage one's teacher identity (teacher_cache.backends: the folder checks and the
weights hash). The teacher runs through student.model.Student, the decoder the students are pruned
from, so teacher and student go through the same chunks (long sequences in --chunk-tokens pieces)
and the teacher's final hidden states meet its lm-head in row chunks, never as [tokens, V] logits.
The cost: a teacher must be of a family that decoder loads (Llama, Qwen2/3, Mistral, SmolLM2).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from distill.errors import DistillUserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalTeacher:
    """An HF folder to run as the teacher (``"default"``: the embedded SmolLM2-135M-Instruct, as
    the quickstart and recipes name it). Called with the cache's reader and the device, it checks
    and loads it (student.evaluate.TeacherOpener)."""

    model: str | Path

    def folder(self) -> Path:
        from pipelines.defaults import default_teacher_dir

        return default_teacher_dir() if str(self.model) in ("", "default") else Path(self.model)

    def __call__(self, reader, device: str):
        """The teacher as a ``Student`` in float32 on `device`, after the checks: its tokenizer must
        be the cache's (one line naming --teacher otherwise); weights other than those the cache was
        built from only warn (a teacher re-saved elsewhere, or in another dtype, hashes differently)."""
        import torch

        from student.model import Student
        from teacher_cache.backends import open_teacher_folder, weights_hash
        from teacher_cache.identity import tokenizer_info

        spec = reader.manifest.spec
        try:
            opened = open_teacher_folder(self.folder())
        except DistillUserError as e:
            raise DistillUserError(f"--teacher: {e}") from None
        tokenizer_hash = tokenizer_info(opened.tokenizer)["hash"]
        if tokenizer_hash != spec.tokenizer.hash:
            raise DistillUserError(
                f"--teacher {opened.path}: its tokenizer (hash {tokenizer_hash}) is not the cache's (hash "
                f"{spec.tokenizer.hash}); pass the teacher the cache was built from ({spec.teacher.path})")
        if weights_hash(opened.path) != spec.teacher.weights_hash:
            log.warning("--teacher %s: its weights differ from those the cache was built from (%s); full_vocab_kl "
                        "measures the student against this teacher", opened.path, spec.teacher.path)
        try:
            teacher = Student.from_pretrained(opened.path, dtype=torch.float32, device=device)
        except DistillUserError as e:
            raise DistillUserError(f"--teacher {opened.path}: {e} (eval runs the teacher with the student decoder)"
                                   ) from None
        if teacher.config.vocab_size < spec.tokenizer.vocab_size:
            raise DistillUserError(f"--teacher {opened.path} has vocab {teacher.config.vocab_size}, smaller than the "
                                   f"cache's {spec.tokenizer.vocab_size}; pass the teacher the cache was built from")
        return teacher
