"""Gradient clipping by global L2 norm in one pass, without a host sync.

Per (device, dtype) group one `torch._foreach_norm` gives per-tensor norms in fp32 (bf16 and fp16
grads are accumulated in fp32 and never rounded back to their own dtype); the global norm is the
fp32 norm of those, in the order of the parameters; one `torch._foreach_mul_` per group scales fp32
grads by a coefficient kept on the device; bf16 and fp16 grads are scaled one tensor at a time, so
that the product is computed in fp32 and rounded once (torch's foreach multiply would round the
coefficient to the grads' dtype first). The trainer runs on a CPU or a CUDA device, both of which
have foreach kernels.

Unlike torch.nn.utils.clip_grad_norm_, a non-finite total norm leaves the gradients as they are
(torch multiplies them by NaN), so the caller can inspect the returned norm and skip the step.

The pieces are public for the offload runtime (student/offload/runtime.py), which measures the norms of
its host layers' gradients on the device as they pass and scales those gradients inside its update:
`total_grad_norm` takes such norms as known, `clip_coefficient` gives the coefficient to apply
later, `scale_grads_` scales the rest now. `clip_grad_norm_foreach` is the three in a row.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch

__all__ = ["clip_grad_norm_foreach", "total_grad_norm", "clip_coefficient", "scale_grads_"]


def _grads_by_device_and_dtype(grads: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        groups[(grad.device, grad.dtype)].append(grad)
    return groups


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A copy to the host is blocking: the host reads it at once (offloaded training has host and device grads).
    return tensor.to(device, non_blocking=device.type != "cpu")


def total_grad_norm(params: Iterable[torch.Tensor], known: Mapping[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(global L2 norm of the grads of `params`, the grads whose norm was computed here).

    known: param -> the 0-dim fp32 L2 norm of its grad, measured elsewhere (its grad is then neither
    read nor returned, and may be None: the offload runtime's compute-dtype host gradients). The norm is a 0-dim fp32 tensor on the first grad's device (0.0 on the CPU
    when no param has a grad); the per-tensor norms enter it in the order of `params`."""
    known = known or {}
    with_grad = [p for p in params if p.grad is not None or p in known]
    if not with_grad:
        return torch.tensor(0.0), []
    first = with_grad[0]
    first_device = first.grad.device if first.grad is not None else known[first].device
    norms: list = [known.get(p) for p in with_grad]
    unknown: dict[tuple, list[int]] = defaultdict(list)  # (device, dtype) -> positions in with_grad
    for k, p in enumerate(with_grad):
        if norms[k] is None:
            unknown[(p.grad.device, p.grad.dtype)].append(k)
    for positions in unknown.values():
        for k, norm in zip(positions, torch._foreach_norm([with_grad[k].grad for k in positions], 2.0,
                                                          dtype=torch.float32)):
            norms[k] = norm
    total = torch.linalg.vector_norm(torch.stack([_to(norm, first_device) for norm in norms]), 2.0)
    return total, [p.grad for p in with_grad if p not in known]


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)), 1 when the norm is NaN or inf: a 0-dim fp32 tensor where
    the norm is."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(total_norm), coef, torch.ones_like(coef))


def scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """grads *= coef, in place, the product in fp32 rounded once to each grad's dtype."""
    for (device, dtype), group in _grads_by_device_and_dtype(grads).items():
        coef_here = _to(coef, device)
        if dtype in (torch.bfloat16, torch.float16):
            # A 0-dim device tensor of another dtype is cast to the grads' dtype before the multiply
            # (torch's fast foreach route needs equal dtypes, its fallback casts the 0-dim operand):
            # on CUDA a bf16 grad is scaled by a coefficient rounded to 8 bits (the GPU test found bf16
            # grads 2 ulps off on an H200; the cause read from torch's source). An expanded fp32
            # operand takes part in type promotion: the product is fp32, rounded once.
            for grad in group:
                grad.mul_(coef_here.expand(grad.shape))
        else:
            torch._foreach_mul_(group, coef_here)


def check_max_norm(max_norm: float) -> float:
    max_norm = float(max_norm)
    if not max_norm > 0:
        raise ValueError(f"`max_norm` must be > 0 (or inf to only measure), got {max_norm}")
    return max_norm


def clip_grad_norm_foreach(params: torch.Tensor | Iterable[torch.Tensor], max_norm: float, *,
                           error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the grads of `params` so that their global L2 norm is at most `max_norm`.

    Returns the total norm before clipping, a 0-dim fp32 tensor on the first grad's device (0.0 on
    the CPU when no param has a grad). The grads are scaled in place by
    min(1, max_norm / (norm + 1e-6)); when the norm is NaN or inf they are left untouched.
    `max_norm=inf` only measures. `error_if_nonfinite=True` raises RuntimeError on a non-finite
    norm, which costs one host sync.
    """
    if isinstance(params, torch.Tensor):
        params = [params]
    max_norm = check_max_norm(max_norm)
    total_norm, grads = total_grad_norm(params)
    if not grads:
        return total_norm
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(
            f"The total norm of the gradients is {total_norm.item()}, so they cannot be clipped; "
            "pass error_if_nonfinite=False to get the norm back and skip the step instead"
        )
    if not math.isinf(max_norm):
        scale_grads_(grads, clip_coefficient(total_norm, max_norm))
    return total_norm
