"""The per-position teacher targets that flow from a backend to the cache writer and back out of the reader.

Convention (cache format v1): row ``t`` of a sequence holds the teacher's distribution over the
token at ``t + 1`` given tokens ``0..t``. The last row of a sequence has no next token: its top-k
targets are valid and its ``target_logprob`` is NaN.

A sampled cache (``targets.kind == "sampled"``, RS-KD) has S slots per row instead of the top-k:
the unique ids drawn from the proposal, by count descending then id ascending, then padding slots
of count 0 (see kernels/sample_targets.py); ``sample_counts`` says how often each was drawn.
``Sampling`` gives every sequence its own uniforms, so the draws depend on the seed and the
sequence's index in the cache only, never on batching, shards or workers.

A hybrid cache (``targets.kind == "topk+sampled"``) has K + S slots per row: the teacher's exact
top-K (count 0, descending probability), then S draws from the teacher outside that top-K as a
sampled row's slots; ``tail_logmass`` is log(1 - the top-K's mass), as in a top-k cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TeacherTargets:
    """Targets for the positions of one or more sequences, concatenated along the first axis.

    All log-probabilities are over the full vocabulary at the cache temperature (not renormalised
    over the top-k).
    """

    topk_ids: np.ndarray  # int32 [N, k], descending teacher probability (sampled: slot order)
    topk_logprobs: np.ndarray  # float32 [N, k]
    # float32 [N] = log(1 - sum(exp(topk_logprobs))) (sampled: over count > 0; hybrid: over the top-K)
    tail_logmass: np.ndarray
    target_logprob: np.ndarray  # float32 [N], NaN on the last row of each sequence
    sample_counts: np.ndarray | None = None  # uint8 [N, k], draws per slot (sum samples); None: top-k
    proposal_logprobs: np.ndarray | None = None  # float32 [N, k]; None: the proposal is the teacher

    def __post_init__(self) -> None:
        n, k = self.topk_ids.shape
        assert self.topk_logprobs.shape == (n, k), (self.topk_logprobs.shape, (n, k))
        assert self.tail_logmass.shape == (n,) and self.target_logprob.shape == (n,)
        for name in ("sample_counts", "proposal_logprobs"):
            value = getattr(self, name)
            assert value is None or value.shape == (n, k), (name, None if value is None else value.shape, (n, k))
        assert self.proposal_logprobs is None or self.sample_counts is not None, "proposal log-probs without counts"

    @property
    def sampled(self) -> bool:
        return self.sample_counts is not None

    @property
    def arrays(self) -> tuple[np.ndarray | None, ...]:
        """Every field in order (None for an absent optional one)."""
        return (self.topk_ids, self.topk_logprobs, self.tail_logmass, self.target_logprob, self.sample_counts,
                self.proposal_logprobs)

    @property
    def num_positions(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def k(self) -> int:
        return self.topk_ids.shape[1]

    @staticmethod
    def concat(parts: list["TeacherTargets"]) -> "TeacherTargets":
        columns = zip(*(p.arrays for p in parts))
        return TeacherTargets(*(None if col[0] is None else np.concatenate(col) for col in columns))

    def slice(self, start: int, stop: int) -> "TeacherTargets":
        return TeacherTargets(*(None if a is None else a[start:stop] for a in self.arrays))


def tail_logmass_from_topk(topk_logprobs: np.ndarray) -> np.ndarray:
    """log(1 - sum(exp(topk))) per row.

    topk_logprobs: float [N, k]. Returns float32 [N]. The sum is taken in float64; a top-k whose
    mass rounds to 1 or more gets log(1e-12) instead of -inf or NaN, so losses stay finite.
    """
    mass = np.exp(topk_logprobs.astype(np.float64)).sum(axis=1)
    return np.log(np.clip(1.0 - mass, 1e-12, None)).astype(np.float32)


@dataclass(frozen=True)
class Sampling:
    """What a sampled cache draws: ``samples`` ids per position from the teacher's distribution at
    ``proposal_temperature`` (the cache temperature when the proposal is the teacher itself).

    The uniforms of sequence i (its global index in the cache) come from a Philox generator seeded
    by (seed, i): row t uses draws t * S .. t * S + S - 1 of that stream, so any block of rows can
    be generated alone (a long sequence prefilled chunk by chunk gets the same draws).
    """

    samples: int
    proposal_temperature: float
    seed: int
    # exact top ids kept per position before the draws, which then come from outside them (a
    # topk+sampled cache); 0: none. The uniforms do not depend on it.
    topk: int = 0

    @property
    def slots(self) -> int:
        """Entries per position: topk + samples."""
        return self.topk + self.samples

    def uniforms(self, sequence: int, start: int, stop: int) -> np.ndarray:
        """float64 [stop - start, samples] in [0, 1): rows start..stop of sequence ``sequence``."""
        first = start * self.samples
        bits = np.random.Philox(np.random.SeedSequence([self.seed, sequence]))
        bits.advance(first // 4)  # Philox makes 4 64-bit words per counter step, one per float64
        skip = first % 4
        draws = np.random.Generator(bits).random(skip + (stop - start) * self.samples)
        return draws[skip:].reshape(stop - start, self.samples)


def canonical_slots(ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The per-row permutation int64 [N, S] that puts sampled slots in cache order: count
    descending, then id ascending (padding, count 0, last). ids, counts: [N, S]."""
    return np.lexsort((ids, -counts.astype(np.int64)), axis=1)
