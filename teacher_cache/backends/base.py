"""The one small protocol every teacher backend implements, and the input checks they share.

The implementations (``hf``, ``vllm``) import this module; only ``teacher_cache.backends``
(``make_backend``) imports them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from distill.errors import DistillUserError
from teacher_cache.targets import TeacherTargets

# Longest sequence a backend runs in one forward; longer ones are prefilled in chunks of this
# many tokens through the teacher's KV cache. As many tokens as the default batch of packed
# sequences (CacheConfig: 8 x 1024), so a chunk keeps a GPU as busy as a batch does and the
# default corpus never takes the chunked path.
PREFILL_TOKENS = 8192
_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}  # fmt: skip


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


def canonical_dtype(dtype: str) -> str:
    """"bf16" -> "bfloat16" etc.; DistillUserError for anything else."""
    if not isinstance(dtype, str) or dtype.lower() not in _DTYPE_ALIASES:
        raise DistillUserError(f"teacher dtype must be one of bfloat16, float16, float32, got {dtype!r}")
    return _DTYPE_ALIASES[dtype.lower()]


def check_k(k: int, vocab_size: int, limit: int | None = None, limit_hint: str = "") -> None:
    """``k`` in [1, vocab_size] and at most the backend's ``limit`` (DistillUserError, with ``limit_hint``)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= vocab_size:
        raise DistillUserError(f"k must be in [1, vocab_size={vocab_size}], got {k}")
    if limit is not None and k > limit:
        raise DistillUserError(f"k must be at most {limit} for this backend, got {k}{limit_hint}")


def check_temperature(temperature: float) -> float:
    """A positive finite cache temperature, as a float (DistillUserError otherwise)."""
    if not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
        raise DistillUserError(f"temperature must be a positive finite number, got {temperature!r}")
    return float(temperature)


def check_sequences(sequences, vocab_size: int, max_len: int | None = None, max_len_hint: str = "") -> list[np.ndarray]:
    """Validate token sequences; returns them as int64 arrays (the caller's arrays are not changed)."""
    if isinstance(sequences, np.ndarray) and sequences.ndim == 1:
        raise DistillUserError("sequences must be a list of 1-D token-id arrays, got one 1-D array; wrap it in a list")
    out = []
    for i, seq in enumerate(sequences):
        arr = np.asarray(seq)
        if arr.ndim != 1 or not (arr.dtype.kind in "iu" or arr.size == 0):
            raise DistillUserError(
                f"sequence {i} must be a 1-D array of integer token ids, got dtype {arr.dtype} with shape {arr.shape}"
            )
        if arr.size < 2:
            raise DistillUserError(f"sequence {i} has {arr.size} token(s); the teacher needs at least 2 per sequence")
        if max_len is not None and arr.size > max_len:
            raise DistillUserError(f"sequence {i} has {arr.size} tokens, more than the allowed {max_len}{max_len_hint}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise DistillUserError(
                f"sequence {i} holds token id {bad}, outside [0, vocab_size={vocab_size}); "
                "was it tokenized with the teacher's tokenizer?"
            )
        out.append(arr.astype(np.int64, copy=False))
    return out


def split_rows(arrays: tuple[np.ndarray, ...], lengths: list[int]) -> list[tuple[np.ndarray, ...]]:
    """Split arrays concatenated along axis 0 back into per-sequence pieces of ``lengths`` rows."""
    bounds = np.cumsum([0] + list(lengths))
    return [tuple(a[bounds[i] : bounds[i + 1]] for a in arrays) for i in range(len(lengths))]
