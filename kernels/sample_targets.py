"""Sampled teacher targets (RS-KD) from the lm-head: S draws per row, as unique ids with counts.

Given final hidden states, the lm-head weight and S uniforms per row, draw S ids per row with
replacement from the proposal softmax(logits / proposal_temperature) by inverse CDF, and return
them as cache slots: the u unique drawn ids first, by count descending then id ascending, then
S - u padding slots with count 0 holding the smallest ids that were not drawn (distinct from each
other and from the drawn ids, as the fused loss's Triton path needs). Every slot carries the
teacher's full-vocabulary log-probability at the cache temperature, and, when the proposal
differs from the teacher, the proposal's.

With ``head`` = K > 0 (a hybrid cache, ``--targets topk+sampled``) each row first holds the
teacher's exact top-K ids (descending probability), and the S draws come from the proposal
restricted to the ids outside that top-K and renormalised; the padding avoids the top-K too, so a
row's K + S ids stay distinct. ``tail_logmass`` is then log(1 - P_K), the mass outside the top-K,
and the proposal's log-probs (stored only when the proposal differs from the teacher) are those of
the restricted, renormalised proposal: the distribution the ids were drawn from.

The draws are a pure function of the logits and the uniforms: the caller owns the randomness
(teacher_cache.targets.Sampling gives each sequence its own uniforms), so the cache does not
depend on batching or on the device's random number generator. Torch only: per row this costs a
softmax, a float64 cumulative sum over the vocabulary and S binary searches, which on a GPU is not
small next to a small teacher's forward (rows `teacher_gpu/*/rs12@b0b7c04` against
`teacher_gpu/*/default@b0b7c04`, RESULTS.md, "Teacher capture"): a fused kernel is the next step. The CDF is
summed in float64 so that the interval of a token of probability p keeps its width down to
p ~ 1e-16 (float32 would lose ids below ~6e-8 to rounding near the top of the CDF).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distill.configs import check_types, require
from kernels.topk_logprobs import floor_tail_logmass, tail_logmass, target_logprobs


@dataclass(frozen=True)
class SampleSettings:
    """How ``sample_targets`` runs (never what it computes)."""

    # Bytes of per-chunk temporaries (fp32 logits and probabilities, float64 CDF: 16 bytes per
    # logit) when chunk_size is None.
    chunk_bytes: int = 512 * 2**20

    def __post_init__(self):
        check_types(self)
        require("chunk_bytes", self.chunk_bytes, self.chunk_bytes >= 1, "a positive number of bytes")


def _slots(draws_CS: torch.Tensor, vocab_size: int,
           head_CK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [C, S], counts int64 [C, S]) in slot order from the draws int64 [C, S]; the
    padding ids avoid the drawn ids and head_CK int64 [C, K] (a hybrid row's exact top-K), if any."""
    C, S = draws_CS.shape
    same_CSS = draws_CS[:, :, None] == draws_CS[:, None, :]
    count_CS = same_CSS.sum(-1)
    earlier = torch.ones(S, S, dtype=torch.bool, device=draws_CS.device).tril(-1)
    first_CS = ~(same_CSS & earlier).any(-1)  # the first draw of each id
    # Padding candidates 0..S+K-1: at most u + K of them are taken, so at least S - u remain.
    taken_CT = draws_CS if head_CK is None else torch.cat([draws_CS, head_CK], 1)
    cand_S = torch.arange(taken_CT.shape[1], device=draws_CS.device)
    free_CS = ~(cand_S[None, :, None] == taken_CT[:, None, :]).any(-1)
    # One sort key: count descending, then id ascending; padding has count 0; dropped entries last.
    drop = (S + 2) * vocab_size
    key_drawn = torch.where(first_CS, (S - count_CS) * vocab_size + draws_CS, drop)
    key_pad = torch.where(free_CS, S * vocab_size + cand_S, drop)
    key_CS = torch.cat([key_drawn, key_pad], 1).sort(dim=1).values[:, :S]
    return key_CS % vocab_size, S - key_CS // vocab_size


def sample_targets_torch(hidden, weight, uniforms, next_ids, temperature, proposal_temperature, chunk_size,
                         head: int = 0):
    """The implementation; inputs are assumed valid (see ``sample_targets``)."""
    N, S, V, device = hidden.shape[0], uniforms.shape[1], weight.shape[0], hidden.device
    K = head
    ids = torch.empty(N, K + S, dtype=torch.int32, device=device)
    logprobs = torch.empty(N, K + S, dtype=torch.float32, device=device)
    counts = torch.zeros(N, K + S, dtype=torch.uint8, device=device)  # the exact head's slots stay 0
    differs = proposal_temperature != temperature
    proposal = torch.empty(N, K + S, dtype=torch.float32, device=device) if differs else None
    if differs and K:
        proposal[:, :K] = float("-inf")  # the restricted proposal never draws a top-K id
    tail = torch.empty(N, dtype=torch.float32, device=device)
    target = torch.empty(N, dtype=torch.float32, device=device)
    for start in range(0, N, chunk_size):
        stop = min(start + chunk_size, N)
        logits_CV = (hidden[start:stop] @ weight.T).float()  # matmul in the input dtype
        proposal_CV = logits_CV / proposal_temperature if differs else None
        scaled_CV = logits_CV.div_(temperature)  # in place: one [C, V] fp32 buffer fewer
        lse_C = torch.logsumexp(scaled_CV, dim=-1)
        if differs:
            proposal_lse_C = torch.logsumexp(proposal_CV, dim=-1)
        else:
            proposal_CV, proposal_lse_C = scaled_CV, lse_C
        head_CK, drawn_lse_C = None, proposal_lse_C
        if K:
            head_lp_CK, head_CK = torch.topk(scaled_CV, K, dim=-1, sorted=True)
            head_lp_CK = head_lp_CK - lse_C[:, None]
            # log(1 - P_K) as the log of the mass outside the top-K, not from 1 - P_K, which cancels
            # (first, so that its [C, V] temporary is gone before the CDF's buffers exist)
            outside_lse_C = torch.logsumexp(scaled_CV.scatter(1, head_CK, float("-inf")), dim=-1) if differs else None
            # Draw from the proposal outside the top-K, renormalised in log space (so a tail far
            # below the top-K's mass keeps its relative precision).
            prob_CV = proposal_CV.scatter(1, head_CK, float("-inf"))
            drawn_lse_C = torch.logsumexp(prob_CV, dim=-1)
            outside_lse_C = drawn_lse_C if outside_lse_C is None else outside_lse_C
            tail[start:stop] = floor_tail_logmass(outside_lse_C - lse_C)
            prob_CV = prob_CV.sub_(drawn_lse_C[:, None]).exp_()
        else:
            prob_CV = torch.exp(proposal_CV - proposal_lse_C[:, None])
        cdf_CV = torch.cumsum(prob_CV, dim=-1, dtype=torch.float64)
        del prob_CV
        # u * total, not u: the probabilities sum to 1 only up to rounding.
        points_CS = uniforms[start:stop] * cdf_CV[:, -1:]
        draws_CS = torch.searchsorted(cdf_CV, points_CS, right=True).clamp_max(V - 1)
        del cdf_CV
        ids_CS, count_CS = _slots(draws_CS, V, head_CK)
        lp_CS = scaled_CV.gather(1, ids_CS) - lse_C[:, None]
        ids[start:stop, K:] = ids_CS.to(torch.int32)
        counts[start:stop, K:] = count_CS.to(torch.uint8)
        logprobs[start:stop, K:] = lp_CS
        if differs:
            # the distribution drawn from (with K > 0 renormalised over the ids outside the top-K)
            proposal[start:stop, K:] = proposal_CV.gather(1, ids_CS) - drawn_lse_C[:, None]
        if K:
            ids[start:stop, :K] = head_CK.to(torch.int32)
            logprobs[start:stop, :K] = head_lp_CK
        else:
            tail[start:stop] = tail_logmass(torch.logsumexp(lp_CS.masked_fill(count_CS == 0, float("-inf")), dim=-1))
        target[start:stop] = target_logprobs(scaled_CV, lse_C, None if next_ids is None else next_ids[start:stop])
    return ids, logprobs, tail, target, counts, proposal


@torch.no_grad()
def sample_targets(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    uniforms: torch.Tensor,
    next_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    proposal_temperature: float | None = None,
    chunk_size: int | None = None,
    *,
    head: int = 0,
    settings: SampleSettings | None = None,
):
    """S ids per row drawn from softmax(hidden @ weight.T / proposal_temperature), as cache slots.

    hidden: [N, d] final hidden states (fp32, bf16 or fp16); weight: [V, d] lm-head, same dtype
    and device. uniforms: float32/float64 [N, S] in [0, 1), one per draw (S <= 255, S <= V).
    next_ids: int32/int64 [N], the actual next token per row, -1 where there is none (or None).
    temperature: the cache temperature T of the stored log-probs. proposal_temperature: the
    temperature of the distribution drawn from (None: T, the teacher itself). chunk_size: rows
    per chunk (None: from ``settings.chunk_bytes``). head: K exact top ids per row before the
    draws (a hybrid cache; 0: none), the draws then from the proposal outside them (module doc).

    Returns, on hidden's device (the fields of teacher_cache.targets.TeacherTargets, in order),
    with K + S slots per row (K = head):
      ids int32 [N, K + S]: the exact top-K by descending probability; then the unique drawn ids by
        count descending, then id ascending; then padding;
      logprobs float32 [N, K + S]: log_softmax(logits / T) at those ids (padding included);
      tail_logmass float32 [N]: log(1 - the mass of the top-K, or with K = 0 of the drawn ids),
        floored at log(1e-12);
      target_logprob float32 [N]: log-prob at T of next_ids, NaN where next_ids is -1 or None;
      counts uint8 [N, K + S]: draws of each slot's id (sum S per row; 0 on the top-K and padding);
      proposal_logprobs float32 [N, K + S] of the distribution drawn from (with K > 0 restricted
        to the ids outside the top-K and renormalised; -inf on the top-K), or None when the
        proposal temperature equals T.
    """
    proposal_temperature = temperature if proposal_temperature is None else proposal_temperature
    _validate(hidden, weight, uniforms, next_ids, temperature, proposal_temperature, chunk_size, settings, head)
    settings = settings if settings is not None else SampleSettings()
    rows = chunk_size or max(1, settings.chunk_bytes // (16 * weight.shape[0]))
    return sample_targets_torch(hidden, weight, uniforms, next_ids, float(temperature), float(proposal_temperature),
                                rows, head)


def _validate(hidden, weight, uniforms, next_ids, temperature, proposal_temperature, chunk_size, settings,
              head=0) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, d] and weight [V, d], got shapes {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype or not hidden.dtype.is_floating_point or hidden.device != weight.device:
        raise ValueError(f"hidden and weight must be floating-point tensors of one dtype on one device, got "
                         f"{hidden.dtype} on {hidden.device} and {weight.dtype} on {weight.device}")
    N, V = hidden.shape[0], weight.shape[0]
    if uniforms.dim() != 2 or uniforms.shape[0] != N or uniforms.dtype != torch.float64:
        # float64: a float32 uniform may round up to 1.0, past the end of the CDF
        raise ValueError(f"uniforms must be float64 [N={N}, S], got {uniforms.dtype} {tuple(uniforms.shape)}")
    if uniforms.device != hidden.device:
        raise ValueError(f"uniforms must be on {hidden.device}, got {uniforms.device}")
    S = uniforms.shape[1]
    if not 1 <= S <= min(255, V):
        raise ValueError(f"the number of samples S (uniforms' second dim) must be in [1, min(255, vocab_size={V})], "
                         f"got {S}")
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head <= V - S:
        raise ValueError(f"head (exact top ids per row) must be an int in [0, vocab_size - S = {V - S}], got {head!r}")
    for name, t in (("temperature", temperature), ("proposal_temperature", proposal_temperature)):
        if not (t > 0 and t != float("inf")):
            raise ValueError(f"{name} must be a positive finite number, got {t}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if settings is not None and not isinstance(settings, SampleSettings):
        raise ValueError(f"settings must be a SampleSettings or None, got {type(settings).__name__}")
    if next_ids is not None and (next_ids.shape != (N,) or next_ids.dtype not in (torch.int32, torch.int64)
                                 or next_ids.device != hidden.device):
        raise ValueError(f"next_ids must be int32/int64 [N={N}] on {hidden.device}, got {next_ids.dtype} "
                         f"{tuple(next_ids.shape)} on {next_ids.device}")
