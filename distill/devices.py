"""Resolution of the "auto" device and dtype settings, in one place (a leaf: imports nothing of ours)."""

from __future__ import annotations

from distill.errors import DistillUserError

DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(device: str, option: str = "--device") -> str:
    """"auto" -> "cuda" when torch sees a GPU, else "cpu"; refuses a CUDA device torch cannot see."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise DistillUserError(f"{option} must be 'auto', 'cpu' or 'cuda[:i]', got {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise DistillUserError(f"{option} is {device!r} but torch sees no CUDA device; use 'cpu' or 'auto'")
    return device


def resolve_dtype(dtype: str, device: str, option: str = "--dtype") -> str:
    """"auto" -> "bfloat16" on a GPU, "float32" on a CPU (CPUs without AVX-512 BF16 run bf16
    matmuls many times slower than fp32). `device` is a resolved device string."""
    if dtype not in DTYPES:
        raise DistillUserError(f"{option} must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"
