"""How much attention a chunk's queries give each past page, by the pages' mean keys: the score by
which sparse chunk-recurrent training picks the past pages a chunk attends
(student/long_context/store.py's `select_pages`, OOMB's page top-k).

``page_mass(q_group, mean_k)`` -> [B, J] fp32: for row b, page j, the sum over kv heads h and
queries t of softmax_j(q_group[b, h, t] . mean_k[j, b, h]) (no 1/sqrt(D), as OOMB scores).
q_group [B, Hkv, T, D]: the chunk's queries summed over each GQA group; mean_k [J, B, Hkv, D] fp32.

Paths: "torch", the reference and the CPU path: the [T, J] scores of 1,024 queries at a time
materialized in fp32, softmaxed and summed (four passes over them in memory). "triton"
(kernels/page_select_triton.py): two passes that never hold the scores, each query's logsumexp
over the pages, then each page's mass, on the tensor cores (`PageSelectSettings.precision`).
"auto": triton on CUDA where the head size is a power of two >= 16 (tl.dot's widths), else
torch. The work is 2 x Hkv x T x J x D multiply-adds a pass, J the pages before
the chunk, so a step's selections grow with the square of its length.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None

if triton is not None:
    from kernels.page_select_triton import _lse_kernel, _mass_kernel

__all__ = ["PageSelectSettings", "page_mass"]

IMPLS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class PageSelectSettings:
    """How the Triton path runs; every setting gives the same scores to rounding. precision: tl.dot's
    input precision for fp32 ("tf32x3": three tf32 products, near fp32's rounding on the tensor
    cores; "tf32"; "ieee")."""

    block_t: int = 64
    block_j: int = 64
    num_warps: int = 4
    precision: str = "tf32x3"


def page_mass(q_group: torch.Tensor, mean_k: torch.Tensor, *, impl: str = "auto",
              settings: PageSelectSettings = PageSelectSettings()) -> torch.Tensor:
    """[B, J] fp32: each past page's attention mass from the chunk's queries (module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    B, Hkv, T, D = q_group.shape
    if mean_k.shape[1:] != (B, Hkv, D):
        raise ValueError(f"mean_k must be [J, {B}, {Hkv}, {D}] for q_group {tuple(q_group.shape)}, "
                         f"got {tuple(mean_k.shape)}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if impl == "triton" and (triton is None or not (q_group.is_cuda or interpreted)):
        raise ValueError(f"impl='triton' needs Triton and CUDA tensors (or TRITON_INTERPRET=1), got "
                         f"{q_group.device}; use impl='auto' or 'torch'")
    fits = D >= 16 and D & (D - 1) == 0  # tl.dot's operand widths
    if impl == "triton" and not fits:
        raise ValueError(f"impl='triton' needs a head size that is a power of two >= 16, got {D}; use impl='torch'")
    if impl == "torch" or (impl == "auto" and (triton is None or not q_group.is_cuda or not fits)):
        return _page_mass_torch(q_group, mean_k)
    return _page_mass_triton(q_group, mean_k, settings)


def _page_mass_torch(q_group, mean_k) -> torch.Tensor:
    q, keys = q_group.float(), mean_k.float().permute(1, 2, 3, 0)  # [B, Hkv, D, J]
    mass = torch.zeros(q.shape[0], mean_k.shape[0], device=q.device)
    for t in range(0, q.shape[2], 1024):  # [.., 1024, J] at a time, never [T, J]
        mass += (q[:, :, t:t + 1024] @ keys).softmax(-1).sum((1, 2))
    return mass


def _page_mass_triton(q_group, mean_k, settings: PageSelectSettings) -> torch.Tensor:
    B, Hkv, T, D = q_group.shape
    J = mean_k.shape[0]
    q = q_group.float().contiguous()
    keys = mean_k.float().contiguous()
    lse = torch.empty(B * Hkv, T, device=q.device, dtype=torch.float32)
    mass = torch.empty(B * Hkv, J, device=q.device, dtype=torch.float32)
    common = dict(D=D, BLOCK_T=settings.block_t, BLOCK_J=settings.block_j, PRECISION=settings.precision,
                  num_warps=settings.num_warps)
    _lse_kernel[(triton.cdiv(T, settings.block_t), B * Hkv)](q, keys, lse, T, J, B * Hkv * D, **common)
    _mass_kernel[(triton.cdiv(J, settings.block_j), B * Hkv)](q, keys, lse, mass, T, J, B * Hkv * D, **common)
    return mass.view(B, Hkv, J).sum(1)
