"""The per-position teacher targets that flow from a backend to the cache writer and back out of the reader.

Convention (cache format v1): row ``t`` of a sequence holds the teacher's distribution over the
token at ``t + 1`` given tokens ``0..t``. The last row of a sequence has no next token: its top-k
targets are valid and its ``target_logprob`` is NaN.
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

    topk_ids: np.ndarray  # int32 [N, k], descending teacher probability
    topk_logprobs: np.ndarray  # float32 [N, k]
    tail_logmass: np.ndarray  # float32 [N] = log(1 - sum(exp(topk_logprobs)))
    target_logprob: np.ndarray  # float32 [N], NaN on the last row of each sequence

    def __post_init__(self) -> None:
        n, k = self.topk_ids.shape
        assert self.topk_logprobs.shape == (n, k), (self.topk_logprobs.shape, (n, k))
        assert self.tail_logmass.shape == (n,) and self.target_logprob.shape == (n,)

    @property
    def num_positions(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def k(self) -> int:
        return self.topk_ids.shape[1]

    @staticmethod
    def concat(parts: list["TeacherTargets"]) -> "TeacherTargets":
        return TeacherTargets(
            topk_ids=np.concatenate([p.topk_ids for p in parts]),
            topk_logprobs=np.concatenate([p.topk_logprobs for p in parts]),
            tail_logmass=np.concatenate([p.tail_logmass for p in parts]),
            target_logprob=np.concatenate([p.target_logprob for p in parts]),
        )

    def slice(self, start: int, stop: int) -> "TeacherTargets":
        return TeacherTargets(
            self.topk_ids[start:stop],
            self.topk_logprobs[start:stop],
            self.tail_logmass[start:stop],
            self.target_logprob[start:stop],
        )


def tail_logmass_from_topk(topk_logprobs: np.ndarray) -> np.ndarray:
    """log(1 - sum(exp(topk))) per row.

    topk_logprobs: float [N, k]. Returns float32 [N]. The sum is taken in float64; a top-k whose
    mass rounds to 1 or more gets log(1e-12) instead of -inf or NaN, so losses stay finite.
    """
    mass = np.exp(topk_logprobs.astype(np.float64)).sum(axis=1)
    return np.log(np.clip(1.0 - mass, 1e-12, None)).astype(np.float32)
