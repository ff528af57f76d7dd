"""Value codecs: how the top-k ids and log-probabilities of a shard are turned into stored arrays.

A codec maps (topk_ids int32 [N, k], topk_logprobs float32 [N, k]) to a dict of named numpy
arrays whose first axis is N, and back. The storage layer (Zarr or Parquet) then compresses those
arrays losslessly. Codecs that reorder ids must return them, after decoding, in descending
teacher probability (cache format v1).

Codecs: ``fp32``, ``bf16``, ``fp16`` (ids as int32 in rank order, values as floats) and ``sqrt8``
(ids delta-coded in ascending order, values quantised uniformly in sqrt(p); see ``SqrtCodec``).
Measured sizes and distortion on real teacher data: tests/benchmarks/RESULTS.md, "Value codecs".
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from teacher_cache.errors import CacheError


class ValueCodec(Protocol):
    name: str

    def encode(self, topk_ids: np.ndarray, topk_logprobs: np.ndarray) -> dict[str, np.ndarray]: ...

    def decode(self, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]: ...


class FloatCodec:
    """Ids as int32 in rank order; log-probs as a plain float type (bf16 kept as its uint16 bits)."""

    def __init__(self, name: str):
        self.name = name

    def encode(self, topk_ids: np.ndarray, topk_logprobs: np.ndarray) -> dict[str, np.ndarray]:
        values = np.ascontiguousarray(topk_logprobs, dtype=np.float32)
        if self.name == "fp16":
            values = values.astype(np.float16)
        elif self.name == "bf16":
            values = _float32_to_bf16_bits(values)
        return {"topk_ids": np.ascontiguousarray(topk_ids, dtype=np.int32), "topk_logprobs": values}

    def decode(self, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        values = arrays["topk_logprobs"]
        if self.name == "bf16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return arrays["topk_ids"].astype(np.int32, copy=False), values.astype(np.float32, copy=False)


class SqrtCodec:
    """Top-k as delta-coded ascending ids plus ``bits``-bit codes of sqrt(p), no per-row parameters.

    Arrays (N rows, k columns, all in ascending-id order within a row):
      ``topk_id_gaps`` uint16 [N, k]: low 16 bits of the gaps between ascending ids; the first
          column holds the smallest id itself.
      ``topk_id_gaps_hi`` uint8 [N, k]: bits 16..23 of the same gaps (all zero when the vocabulary
          has at most 65,536 ids, nearly all zero otherwise), so ids up to 2^24 - 1 work.
      ``topk_sqrtp`` uint8 [N, k] (uint16 above 8 bits): j = round(L * sqrt(p)), L = 2^bits - 1.

    Decoding: p = (j / L)^2, except j = 0, which decodes to (0.3 / L)^2: about the mean p of the
    entries that land in that bin on real teacher data (0.289 / L would be the mean if sqrt(p) were
    uniform there), never 0, so a KL against decoded targets stays finite. Rank order is recovered
    by sorting the decoded values (descending, stable). Entries with equal codes decode to the same
    probability, so their relative order does not change the distribution; among them ids come out
    ascending.

    Why this shape (tests/benchmarks/RESULTS.md, "Value codecs"): sorted-and-delta-coded ids compress
    far better than rank-ordered int32 ids; the values then lose their rank order, which costs
    less code entropy than rank-ordered ids cost bytes. For small errors KL(p || p_hat) ~=
    2 * sum((sqrt(p) - sqrt(p_hat))^2), so a uniform sqrt(p) grid with step 1/L gives a mean KL ~=
    k / (6 L^2) whatever the distribution; one global grid beat a per-row scale at equal bytes (no
    scale to store, and sharp rows do not get a finer grid they do not need). Worst case, per row:
    each entry adds at most 0.575 / L^2 to the unnormalised KL (at sqrt(p) just below 1.5 / L,
    decoded as 1 / L) and renormalising can only lower it, so KL <= 0.575 k / L^2 for every row.

    KL here means ``codec_kl``: over k + 1 categories (top-k matched by id, plus a tail bucket
    with the exact stored tail mass), both sides renormalised. Decoded top-k probabilities are not
    renormalised by the codec: their sum can differ from 1 - exp(tail_logmass) by the rounding,
    so a loss should renormalise (top-k alone, or top-k plus tail) rather than assume it sums to 1.
    """

    def __init__(self, bits: int = 8, name: str | None = None):
        if not 2 <= bits <= 16:
            raise ValueError(f"bits must be in [2, 16], got {bits}")
        self.bits = bits
        self.name = name or f"sqrt{bits}"
        self.levels = (1 << bits) - 1
        self.code_dtype = np.uint8 if bits <= 8 else np.uint16
        sqrt_p = np.arange(self.levels + 1, dtype=np.float64)
        sqrt_p[0] = _ZERO_CODE_SQRT
        # Decoded log-prob of each code: log((j / L)^2).
        self._logprob_table = (2.0 * np.log(sqrt_p / self.levels)).astype(np.float32)

    def encode(self, topk_ids: np.ndarray, topk_logprobs: np.ndarray) -> dict[str, np.ndarray]:
        """topk_ids int [N, k] (any order, ids in [0, 2^24)); topk_logprobs float [N, k]."""
        topk_ids = np.asarray(topk_ids)
        topk_logprobs = np.asarray(topk_logprobs, dtype=np.float32)
        if topk_ids.ndim != 2 or topk_logprobs.shape != topk_ids.shape:
            raise ValueError(f"topk_ids and topk_logprobs must both be [N, k], got {topk_ids.shape} and "
                             f"{topk_logprobs.shape}")
        if topk_ids.size and (topk_ids.min() < 0 or topk_ids.max() > _MAX_ID):
            raise ValueError(f"codec {self.name} stores token ids in [0, {_MAX_ID}], got ids in "
                             f"[{topk_ids.min()}, {topk_ids.max()}]; use fp16 or fp32 for larger vocabularies")
        if np.isnan(topk_logprobs).any():
            raise ValueError(f"codec {self.name} cannot store NaN log-probabilities; the teacher produced NaNs")
        # Sort (id, column) keys rather than argsort ids: one vectorised sort of unique keys, several
        # times faster, and the order is the same on every machine even if ids repeat.
        k = topk_ids.shape[1]
        shift = max(1, (k - 1).bit_length())
        key_dtype = np.int32 if (_MAX_ID + 1) << shift <= np.iinfo(np.int32).max + 1 else np.int64
        keys = np.sort((topk_ids.astype(key_dtype) << shift) | np.arange(k, dtype=key_dtype), axis=1)
        sorted_ids = keys >> shift
        gaps = np.diff(sorted_ids, axis=1, prepend=0)
        order = (keys & ((1 << shift) - 1)).astype(np.intp)
        sqrt_p = np.exp(0.5 * np.take_along_axis(topk_logprobs, order, axis=1))
        codes = np.rint(np.minimum(sqrt_p, 1.0) * self.levels).astype(self.code_dtype)
        return {
            "topk_id_gaps": (gaps & 0xFFFF).astype(np.uint16),
            "topk_id_gaps_hi": (gaps >> 16).astype(np.uint8),
            "topk_sqrtp": codes,
        }

    def decode(self, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Returns topk_ids int32 [N, k] in descending decoded probability and topk_logprobs float32 [N, k]."""
        gaps = arrays["topk_id_gaps"].astype(np.int32) | (arrays["topk_id_gaps_hi"].astype(np.int32) << 16)
        sorted_ids = np.cumsum(gaps, axis=1, dtype=np.int32)
        codes = arrays["topk_sqrtp"]
        if codes.size and int(codes.max()) > self.levels:
            raise CacheError(f"codec {self.name} found code {int(codes.max())} above its maximum {self.levels}; "
                             "the shard was written by another codec or is damaged")
        # A stable sort of small unsigned ints is a radix sort in numpy: fast, and ties keep ascending ids.
        rank = np.argsort(self.levels - codes, axis=1, kind="stable")
        topk_ids = np.take_along_axis(sorted_ids, rank, axis=1)
        topk_logprobs = self._logprob_table[np.take_along_axis(codes, rank, axis=1)]
        return topk_ids, topk_logprobs


# Lowest bin of SqrtCodec, in units of the step 1/L (see its docstring).
_ZERO_CODE_SQRT = 0.3
_MAX_ID = (1 << 24) - 1


def codec_kl(topk_ids: np.ndarray, topk_logprobs: np.ndarray,
             decoded_ids: np.ndarray, decoded_logprobs: np.ndarray) -> np.ndarray:
    """How far a codec moves each row's distribution: KL(exact || decoded) in nats, float64 [N].

    Over k + 1 categories: the top-k entries, matched by token id, and one tail bucket. Exact side:
    p_i = exp(topk_logprobs_i), tail t = max(1 - sum(p), 0). Decoded side: q_i =
    exp(decoded_logprobs_i) with the same tail t, as a reader that takes the tail from the stored
    float32 ``tail_logmass`` sees it. Each side is renormalised to sum to one (the exact side
    differs from one only by float32 rounding). All arrays are [N, k]; the decoded ids must be a
    per-row permutation of the exact ones (ValueError otherwise).
    """
    exact_order = np.argsort(topk_ids, axis=1)
    decoded_order = np.argsort(decoded_ids, axis=1)
    if not np.array_equal(np.take_along_axis(topk_ids, exact_order, 1),
                          np.take_along_axis(decoded_ids, decoded_order, 1)):
        raise ValueError("decoded ids are not a per-row permutation of the exact ids")
    p = np.exp(np.take_along_axis(topk_logprobs, exact_order, 1).astype(np.float64))
    q = np.exp(np.take_along_axis(decoded_logprobs, decoded_order, 1).astype(np.float64))
    tail = np.clip(1.0 - p.sum(axis=1), 0.0, None)
    exact_norm, decoded_norm = p.sum(axis=1) + tail, q.sum(axis=1) + tail
    norm_ratio = (decoded_norm / exact_norm)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(p / q) + np.log(norm_ratio)), 0.0)
    tail_term = np.where(tail > 0, tail * np.log(decoded_norm / exact_norm), 0.0)
    return (terms.sum(axis=1) + tail_term) / exact_norm


def _float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, returned as the uint16 bit pattern."""
    bits = x.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


_CODECS: dict[str, ValueCodec] = {name: FloatCodec(name) for name in ("fp32", "bf16", "fp16")}
_CODECS["sqrt8"] = SqrtCodec(bits=8)


def register_codec(codec: ValueCodec) -> None:
    _CODECS[codec.name] = codec


def codec_names() -> list[str]:
    return sorted(_CODECS)


def get_codec(name: str) -> ValueCodec:
    if name not in _CODECS:
        raise CacheError(f"value codec must be one of {', '.join(codec_names())}, got {name!r}")
    return _CODECS[name]
