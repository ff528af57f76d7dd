"""Fused lm-head + log-softmax + top-k for the teacher pass.

Given final hidden states and the lm-head weight, return per row the top-k full-vocabulary
log-probabilities at temperature T, the log tail mass outside the top-k, and the log-probability
of the actual next token. Rows are processed in chunks so the [N, V] fp32 logits never exist in
full: per chunk, logits in the input dtype (one matmul), then fp32 scaling, logsumexp, top-k and
a gather.

Layout: ``topk_logprobs_torch`` is the reference (and the CPU path); ``topk_logprobs_triton`` is
the GPU path (one Triton kernel per chunk for logsumexp, target and block maxima, then an exact
top-k over candidate blocks); ``topk_logprobs`` validates inputs and dispatches on ``impl``; how
each path runs is set by ``TopkSettings``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from distill.configs import check_types, require

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path needs no Triton
    triton = None

# Floor of the tail mass, as in teacher_cache.targets.tail_logmass_from_topk: log(1e-12) instead
# of -inf when the top-k holds (numerically) all the mass, so losses stay finite.
_TAIL_MIN_MASS = 1e-12


def tail_logmass(mass_log_C: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(mass_log)) per row, floored at log(1e-12): the log of the mass outside a row's
    stored ids, from the log of their mass (via expm1: accurate when that mass is near 1)."""
    return torch.log((-torch.expm1(mass_log_C)).clamp_min(_TAIL_MIN_MASS))


def floor_tail_logmass(logmass_C: torch.Tensor) -> torch.Tensor:
    """A log tail mass computed directly (the log of the mass outside a row's stored ids), floored
    at log(1e-12) as ``tail_logmass`` floors it."""
    return logmass_C.clamp_min(math.log(_TAIL_MIN_MASS))


def target_logprobs(logits_CV: torch.Tensor, lse_C: torch.Tensor, next_C: torch.Tensor | None) -> torch.Tensor:
    """log-prob of each row's next id under logits_CV (already divided by the temperature) with
    logsumexp lse_C; NaN where next_C is -1, everywhere when next_C is None."""
    if next_C is None:
        return torch.full_like(lse_C, float("nan"))
    picked_C = logits_CV.gather(1, next_C.clamp_min(0)[:, None])[:, 0] - lse_C
    return torch.where(next_C >= 0, picked_C, float("nan"))


@dataclass(frozen=True)
class TopkSettings:
    """How ``topk_logprobs`` runs (never what it computes). Pass one as ``settings=``; the
    defaults are what the product runs."""

    # fp32 logits bytes per chunk of the torch path when chunk_size is None.
    torch_chunk_bytes: int = 256 * 2**20
    # Input-dtype logits bytes per chunk of the Triton path when chunk_size is None (only those
    # exist at once there; no fp32 copy).
    triton_chunk_bytes: int = 2**30
    # Block width of the Triton path's candidate search: the exact top-k lies in the k blocks with
    # the largest maxima, so the final top-k runs over k * sub candidates; the path needs
    # k <= ceil(V / sub).
    sub: int = 64
    # Columns per loop iteration of the Triton row kernel (a multiple of sub).
    tile: int = 2048
    # Fill every output a kernel or chunk is meant to write with NaN (ids with -1) first, so an
    # element left unwritten fails the comparison (tests).
    poison: bool = False

    def __post_init__(self):
        check_types(self)
        for name in ("torch_chunk_bytes", "triton_chunk_bytes"):
            require(name, getattr(self, name), getattr(self, name) >= 1, "a positive number of bytes")
        require("sub", self.sub, self.sub >= 1 and self.sub & (self.sub - 1) == 0, "a power of two")
        require("tile", self.tile, self.tile >= self.sub and self.tile & (self.tile - 1) == 0,
                f"a power of two >= sub={self.sub}")


def _outputs(num_rows: int, k: int, device, settings: TopkSettings):
    """(topk_ids, topk_lp, tail, target) to fill, poisoned when the settings say so."""
    topk_ids = torch.empty(num_rows, k, dtype=torch.int32, device=device)
    topk_lp = torch.empty(num_rows, k, dtype=torch.float32, device=device)
    tail = torch.empty(num_rows, dtype=torch.float32, device=device)
    target = torch.empty(num_rows, dtype=torch.float32, device=device)
    if settings.poison:
        topk_ids.fill_(-1)
        for t in (topk_lp, tail, target):
            t.fill_(float("nan"))
    return topk_ids, topk_lp, tail, target


def topk_logprobs_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    next_ids: torch.Tensor | None,
    temperature: float,
    chunk_size: int,
    settings: TopkSettings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference implementation; inputs are assumed valid (see ``topk_logprobs``)."""
    num_rows, device = hidden.shape[0], hidden.device
    topk_ids, topk_lp, tail, target = _outputs(num_rows, k, device, settings)
    inv_t = 1.0 / temperature
    for start in range(0, num_rows, chunk_size):
        stop = min(start + chunk_size, num_rows)
        logits_CV = (hidden[start:stop] @ weight.T).float()  # matmul in the input dtype
        if inv_t != 1.0:
            logits_CV.mul_(inv_t)
        lse_C = torch.logsumexp(logits_CV, dim=-1)
        vals_CK, ids_CK = torch.topk(logits_CV, k, dim=-1, sorted=True)
        lp_CK = vals_CK - lse_C[:, None]
        topk_ids[start:stop] = ids_CK.to(torch.int32)
        topk_lp[start:stop] = lp_CK
        tail[start:stop] = tail_logmass(torch.logsumexp(lp_CK, dim=-1))
        target[start:stop] = target_logprobs(logits_CV, lse_C, None if next_ids is None else next_ids[start:stop])
    return topk_ids, topk_lp, tail, target


# --- Triton path (GPU) -------------------------------------------------------------------------
# The torch reference spends most of its time outside the matmul: the fp32 copy of the logits,
# the logsumexp passes and a full-width top-k (tests/benchmarks/notes/capture.md, "Teacher pass on the
# H200: where the time goes"). Here one kernel reads each row's bf16 logits once and produces the
# logsumexp, the target logit and the max of every SUB-wide block of the row. The top-k elements
# of a row lie in its k blocks with the largest maxima (each of the k largest elements lifts its
# own block's max to at least the k-th largest value, and no more than k blocks can reach it), so
# the exact top-k is a top-k over those k * SUB candidates only.

if triton is not None:

    @triton.jit
    def _row_stats_kernel(
        logits_ptr, stride_row, next_ids_ptr, lse_ptr, target_ptr, blockmax_ptr, stride_bm,
        V, NB, inv_temp, SUB: tl.constexpr, TILE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, V, TILE):
            offs = start + tl.arange(0, TILE)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temp
            bmax = tl.max(tl.reshape(x, (TILE // SUB, SUB)), axis=1)
            boffs = start // SUB + tl.arange(0, TILE // SUB)
            tl.store(blockmax_ptr + row * stride_bm + boffs, bmax, mask=boffs < NB)
            new_m = tl.maximum(m, tl.max(bmax, axis=0))
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
            m = new_m
        tl.store(lse_ptr + row, m + tl.log(s))
        t = tl.load(next_ids_ptr + row)
        x_t = tl.load(base + tl.where(t >= 0, t, 0)).to(tl.float32) * inv_temp
        tl.store(target_ptr + row, tl.where(t >= 0, x_t, float("nan")))


def _row_stats(logits_CV: torch.Tensor, next_C: torch.Tensor, inv_t: float, settings: TopkSettings):
    """(lse [C], target logit [C] (NaN where next is -1), block maxima [C, ceil(V/SUB)]), fp32."""
    rows, vocab = logits_CV.shape
    num_blocks = triton.cdiv(vocab, settings.sub)
    lse_C = torch.empty(rows, device=logits_CV.device, dtype=torch.float32)
    target_C = torch.empty_like(lse_C)
    blockmax_CB = torch.empty(rows, num_blocks, device=logits_CV.device, dtype=torch.float32)
    if settings.poison:
        for t in (lse_C, target_C, blockmax_CB):
            t.fill_(float("nan"))
    _row_stats_kernel[(rows,)](
        logits_CV, logits_CV.stride(0), next_C, lse_C, target_C, blockmax_CB, blockmax_CB.stride(0),
        vocab, num_blocks, inv_t, SUB=settings.sub, TILE=settings.tile,
    )
    return lse_C, target_C, blockmax_CB


def topk_logprobs_triton(hidden, weight, k, next_ids, temperature, chunk_size, settings: TopkSettings):
    """Same contract as ``topk_logprobs_torch``; needs k <= ceil(V / settings.sub)."""
    num_rows, vocab, device = hidden.shape[0], weight.shape[0], hidden.device
    topk_ids, topk_lp, tail, target = _outputs(num_rows, k, device, settings)
    if next_ids is None:
        next_ids = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    inv_t = 1.0 / temperature
    lane_S = torch.arange(settings.sub, device=device)
    for start in range(0, num_rows, chunk_size):
        stop = min(start + chunk_size, num_rows)
        logits_CV = hidden[start:stop] @ weight.T  # input dtype; never copied to fp32 in full
        lse_C, target_logit_C, blockmax_CB = _row_stats(logits_CV, next_ids[start:stop].contiguous(), inv_t, settings)
        blocks_CK = blockmax_CB.topk(k, dim=1, sorted=False).indices
        cand_CM = (blocks_CK[:, :, None] * settings.sub + lane_S).flatten(1)  # [C, k * SUB] column ids
        cand_vals_CM = logits_CV.gather(1, cand_CM.clamp_max(vocab - 1)).float() * inv_t
        cand_vals_CM.masked_fill_(cand_CM >= vocab, float("-inf"))  # the last block's padding
        vals_CK, pos_CK = cand_vals_CM.topk(k, dim=1, sorted=True)
        lp_CK = vals_CK - lse_C[:, None]
        topk_ids[start:stop] = cand_CM.gather(1, pos_CK).to(torch.int32)
        topk_lp[start:stop] = lp_CK
        tail[start:stop] = tail_logmass(torch.logsumexp(lp_CK, dim=-1))
        target[start:stop] = target_logit_C - lse_C
    return topk_ids, topk_lp, tail, target


def _validate(hidden, weight, k, next_ids, temperature, chunk_size, impl, check_ids, settings) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, d] and weight [V, d], got shapes {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden width {hidden.shape[1]} does not match weight width {weight.shape[1]}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    if not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden must be a floating-point tensor, got {hidden.dtype}")
    if hidden.device != weight.device:
        raise ValueError(f"hidden and weight must be on one device, got {hidden.device} and {weight.device}")
    vocab_size = weight.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size:
        raise ValueError(f"k must be in [1, vocab_size={vocab_size}], got {k}")
    if not (temperature > 0 and temperature != float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if impl == "triton" and triton is None:
        raise ValueError("impl='triton' needs the triton package (pip install triton)")
    if settings is not None and not isinstance(settings, TopkSettings):
        raise ValueError(f"settings must be a TopkSettings or None, got {type(settings).__name__}")
    if next_ids is not None:
        if next_ids.shape != (hidden.shape[0],):
            raise ValueError(f"next_ids must have shape [N]=({hidden.shape[0]},), got {tuple(next_ids.shape)}")
        if next_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"next_ids must be int32 or int64, got {next_ids.dtype}")
        if next_ids.device != hidden.device:
            raise ValueError(f"next_ids must be on {hidden.device}, got {next_ids.device}")
        if check_ids and next_ids.numel() and (next_ids.min() < -1 or next_ids.max() >= vocab_size):
            raise ValueError(
                f"next_ids must be in [0, vocab_size={vocab_size}) or -1 for none, "
                f"got values in [{int(next_ids.min())}, {int(next_ids.max())}]"
            )


@torch.no_grad()
def topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    next_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    impl: str = "auto",
    check_ids: bool = True,
    *,
    settings: TopkSettings | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k full-vocabulary log-probabilities of ``softmax(hidden @ weight.T / temperature)``.

    hidden: [N, d] final hidden states (fp32, bf16 or fp16); weight: [V, d] lm-head, same dtype
    and device. next_ids: int32/int64 [N], the actual next token per row, -1 where there is none
    (or None for no targets). chunk_size: rows per chunk (None: from the settings' byte budgets).
    impl: "auto" (Triton on a CUDA device when k <= ceil(V / settings.sub), else torch) | "torch"
    | "triton" (also runs on the CPU under TRITON_INTERPRET=1, for tests). check_ids: check that
    next_ids lie in [-1, V) (costs a device sync on a GPU; pass False when the caller has
    checked them, as out-of-range ids read outside the logits). settings: how the paths run
    (``TopkSettings``; None: the defaults).

    Returns, on hidden's device:
      topk_ids int32 [N, k] in descending probability;
      topk_logprobs float32 [N, k], log-softmax over the full vocabulary (not renormalised);
      tail_logmass float32 [N] = log(1 - sum(exp(topk_logprobs))), floored at log(1e-12);
      target_logprob float32 [N], log-prob of next_ids, NaN where next_ids is -1 or None.
    """
    _validate(hidden, weight, k, next_ids, temperature, chunk_size, impl, check_ids, settings)
    settings = settings if settings is not None else TopkSettings()
    vocab_size = weight.shape[0]
    max_k = -(-vocab_size // settings.sub)
    use_triton = impl == "triton" or (impl == "auto" and triton is not None and hidden.is_cuda and k <= max_k)
    if use_triton:
        if k > max_k:
            raise ValueError(f"impl='triton' needs k <= ceil(vocab_size / {settings.sub}) = {max_k}, got {k}")
        rows = chunk_size or max(1, settings.triton_chunk_bytes // (hidden.element_size() * vocab_size))
        return topk_logprobs_triton(hidden, weight, k, next_ids, float(temperature), rows, settings)
    rows = chunk_size or max(1, settings.torch_chunk_bytes // (4 * vocab_size))
    return topk_logprobs_torch(hidden, weight, k, next_ids, float(temperature), rows, settings)
