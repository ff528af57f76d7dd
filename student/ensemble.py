"""Teacher ensembles: several teachers' cached top-k targets of the same positions, combined row by
row into one top-k + tail target that the fused loss (kernels/fused_topk_kl.py) reads as it reads
one teacher's, in the same single pass.

Per row, teacher i caches the full-vocabulary probabilities p_i(v) of the ids v of its top-k S_i
and its tail mass t_i = 1 - sum_{S_i} p_i, the mass of every id outside S_i: a distribution over
S_i plus one "everything else" category. With the weights w_i normalised to sum 1, the combined
target is the weighted mixture of those distributions. On the union U of the S_i

    m(v) = sum_i w_i p_i(v),   p_i(v) counted as 0 where v is not in S_i (that mass is in t_i),

and everything else gets sum_i w_i t_i; the masses sum to sum_i w_i (sum_{S_i} p_i + t_i) = 1.
Where v is outside some S_i, m(v) is below the full mixture's probability of v by the part that
lies in those teachers' tails: the ensemble knows no more than its caches. U holds up to
sum_i k_i ids and the kernel reads k a row, so the k ids of highest m are kept (ties: the smaller
id first), in descending order, and the rest of U joins the tail:

    tail = sum_i w_i t_i + sum_{v in U, not kept} m(v)   (= 1 - sum_{kept} m).

A row whose U has fewer than k ids gets the smallest ids absent from it in its remaining slots, at
``EMPTY_LOGPROB`` (probability 0, the filler convention of cross_tokenizer/vocab_map.py), so the
kernel still reads k distinct ids; those ids all lie below k <= V. The loss's "bucket" KL over the
k kept ids plus the tail is zero exactly when the student gives each kept id its m and the other
ids together the tail's mass: its optimum is the mixture. As teacher_cache.targets'
``tail_logmass_from_topk`` does, a tail mass below 1e-12 is stored as log(1e-12), so losses stay
finite.

Sampled and hybrid caches (student/data.py) hold no probabilities to add: a row is a set of drawn
ids u with weights W_i(u), an unbiased estimate of teacher i (E[W_i at v] = p_i(v)). The weighted
sum of unbiased estimates is an unbiased estimate of the mixture, so ``combine_sampled`` keeps
every teacher's slots, each weight scaled by w_i (an id drawn for several teachers gets one slot,
their weights summed): E[W at v] = sum_i w_i p_i(v) = m(v). No slot may be dropped (that would
bias it), so its rows are sum_i k_i wide. The loss's estimate sum_u W_u (l_u - log q_u) needs a
teacher log-probability l_u per slot; a merged slot takes the W-weighted mean of its teachers'
cached l, so the estimate is exactly sum_i w_i KL_est_i: unbiased for sum_i w_i KL(p_i || q) =
KL(m || q) + JS_w(p_1..p_n), the generalised Jensen-Shannon divergence of the teachers, a constant
the student cannot change. Its gradient, sum_i w_i (q - p_i) = q - m in expectation, is exactly the
gradient of KL(m || q): the student learns the mixture, and its loss reads the KL to the mixture
plus the teachers' disagreement. A top-k cache cannot join sampled ones: its tail is one mass with
no ids, which the sampled caches' loss form (tail "unnormalized") drops, so the estimate would lose
that teacher's tail.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from distill.errors import DistillUserError
from student.cross_tokenizer.vocab_map import EMPTY_LOGPROB
from student.data import Batch, CacheBatches, ShardLRU, target_weights
from teacher_cache.reader import CacheReader
from teacher_cache.targets import TeacherTargets

# The cache's floor of the tail mass (teacher_cache.targets.tail_logmass_from_topk).
_TAIL_MIN_MASS = 1e-12


def combine_topk(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], weights, k: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The weighted mixture of several teachers' targets of the same N rows, as top-k + tail (module doc).

    parts: per teacher (topk_ids int [N, k_i], topk_logprobs float [N, k_i] full-vocabulary,
    tail_logmass float [N]); k_i may differ. weights: one >= 0 per part, not all 0 (normalised
    here). Returns (ids int64 [N, k], log-probs float32 [N, k] in descending order, log tail mass
    float32 [N]), computed in float64.
    """
    w = _checked_weights(weights, len(parts))
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise DistillUserError(f"--ensemble-k must be an integer >= 1, got {k!r}")
    rows = {np.shape(part[0])[0] for part in parts} | {np.shape(part[2])[0] for part in parts}
    if len(rows) != 1:
        raise ValueError(f"the teachers' targets must cover the same rows, got row counts {sorted(rows)}")
    used = [(part, wi) for part, wi in zip(parts, w) if wi > 0]  # a weight-0 teacher adds no id
    ids = np.concatenate([np.asarray(part[0], np.int64) for part, _ in used], 1)  # [N, K]
    p = np.concatenate([wi * np.exp(np.asarray(part[1], np.float64)) for part, wi in used], 1)
    tail = sum(wi * np.exp(np.asarray(part[2], np.float64)) for part, wi in used)  # [N]
    ids, (merged,) = _merge_ids(ids, p, width=k)
    # the k most probable; the stable sort of id-ordered rows puts the smaller id first on ties
    top = np.argsort(-merged, 1, kind="stable")[:, :k]
    out_ids, out_p = np.take_along_axis(ids, top, 1), np.take_along_axis(merged, top, 1)
    real = out_p >= 0  # [N, k]: a prefix of each row; the rest are slots past the row's union
    kept = np.where(real, out_p, 0.0).sum(1)
    tail_mass = tail + (np.clip(merged, 0.0, None).sum(1) - kept)
    out_ids = _with_fillers(out_ids, real, ids)
    with np.errstate(divide="ignore", invalid="ignore"):
        out_lp = np.where(out_p > 0, np.log(out_p), EMPTY_LOGPROB)
    tail_lp = np.log(np.maximum(tail_mass, _TAIL_MIN_MASS))
    return out_ids, out_lp.astype(np.float32), tail_lp.astype(np.float32)


def combine_sampled(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], weights
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The weighted mixture of several sampled (or hybrid) teachers' estimates of the same N rows
    (module doc): every teacher's slots, weights scaled by its w_i, repeated ids merged into one slot.

    parts: per teacher (ids int [N, k_i], log-probs float [N, k_i] full-vocabulary, slot weights
    float [N, k_i] as student.data.target_weights gives them; weight-0 slots are padding). weights:
    one >= 0 per part, not all 0. Returns (ids int64 [N, K], log-probs float32 [N, K], slot weights
    float32 [N, K]) with K = sum k_i: the ids in ascending order, then weight-0 fillers (distinct ids
    absent from the row, log-prob ``EMPTY_LOGPROB``); a merged slot's log-prob is the weight-weighted
    mean of its teachers' (so the loss's estimate is the teachers' estimates' weighted sum).
    """
    w = _checked_weights(weights, len(parts))
    ids = np.concatenate([np.asarray(part[0], np.int64) for part in parts], 1)
    slot_w = np.concatenate([wi * np.asarray(part[2], np.float64) for part, wi in zip(parts, w)], 1)
    lp = np.concatenate([np.asarray(part[1], np.float64) for part in parts], 1)
    ids = np.where(slot_w > 0, ids, -1)  # padding slots and weight-0 teachers' ids carry nothing
    width = ids.shape[1]
    ids, (merged_w, merged_wl) = _merge_ids(ids, slot_w, slot_w * np.where(slot_w > 0, lp, 0.0), width=width)
    real = (ids >= 0) & (merged_w >= 0)
    order = np.argsort(~real, 1, kind="stable")  # the row's ids first, ascending, then the empty slots
    ids, merged_w, merged_wl, real = (np.take_along_axis(a, order, 1) for a in (ids, merged_w, merged_wl, real))
    with np.errstate(divide="ignore", invalid="ignore"):
        out_lp = np.where(real & (merged_w > 0), merged_wl / merged_w, EMPTY_LOGPROB)
    return _with_fillers(ids, real, ids), out_lp.astype(np.float32), np.where(real, merged_w, 0.0).astype(np.float32)


def _checked_weights(weights, teachers: int) -> np.ndarray:
    """The teachers' weights normalised to sum 1, or a one-line error naming --ensemble-weights."""
    w = np.asarray(weights, np.float64).ravel()
    if teachers == 0 or len(w) != teachers:
        raise DistillUserError(f"--ensemble-weights needs one weight per teacher ({teachers}), got {len(w)} "
                               f"({list(w)}); give as many weights as teachers")
    if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
        raise DistillUserError(f"--ensemble-weights must be finite, >= 0 and not all 0, got {list(w)}")
    return w / w.sum()


def _merge_ids(ids: np.ndarray, *values: np.ndarray, width: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each row sorted by id, every run of one id (>= 0) summed into its first slot; the other slots
    get -1 in `values` (below every probability or weight). Rows padded with id -1 to `width` slots."""
    order = np.argsort(ids, 1)  # any order of one id's copies: they are summed
    ids = np.take_along_axis(ids, order, 1)
    first = np.ones(ids.shape, bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first &= ids >= 0
    starts = np.flatnonzero(first)
    out = []
    for value in values:
        merged = np.full(ids.shape, -1.0)  # -1: no id of its own; sorts after every probability
        if len(starts):
            merged.flat[starts] = np.add.reduceat(np.take_along_axis(value, order, 1).ravel(), starts)
        out.append(merged)
    pad = ((0, 0), (0, max(width - ids.shape[1], 0)))  # a union narrower than `width`: slots for fillers
    return np.pad(ids, pad, constant_values=-1), [np.pad(m, pad, constant_values=-1.0) for m in out]


def _with_fillers(out_ids: np.ndarray, real: np.ndarray, row_ids: np.ndarray) -> np.ndarray:
    """`out_ids` [N, k] whose slots where not `real` (a suffix of each row) hold the smallest ids that
    appear nowhere in the row's `row_ids`, all below k: the kernel reads k distinct ids a row."""
    if real.all():
        return out_ids
    k = out_ids.shape[1]
    present = np.zeros((len(out_ids), k), bool)
    r, c = np.nonzero((row_ids >= 0) & (row_ids < k))
    present[r, row_ids[r, c]] = True
    absent = np.argsort(present, 1, kind="stable")  # [N, k]: the absent ids first, ascending
    slot = np.clip(np.arange(k) - real.sum(1, keepdims=True), 0, k - 1)
    return np.where(real, out_ids, np.take_along_axis(absent, slot, 1))


class EnsembleBatches(CacheBatches):
    """CacheBatches over the first teacher's cache whose targets are every teacher's, combined row by
    row (``combine_topk`` into `k` slots; sampled or hybrid caches: ``combine_sampled`` into sum_i k_i,
    with slot weights); target_logprob is the mixture's, log sum_i w_i p_i(next). The caches hold the
    same corpus (``check_same_corpus``), so a sequence index and a row offset name the same token in
    each; each cache is read through its own shard cache, one per thread. Combining costs a few sorts
    of every row (numpy's, off the interpreter lock), so Prefetcher builds these on
    ``prefetch_workers`` threads."""

    prefetch_workers = max(1, min(6, (os.cpu_count() or 2) // 2))

    def __init__(self, reader: CacheReader, indices, batch_size: int, *, others: list[CacheReader], weights,
                 k: int, **kwargs):
        super().__init__(reader, indices, batch_size, **kwargs)
        for other in others:
            check_ensemble_kinds(reader, other)
        self._heads = [r.manifest.spec.targets.head for r in (reader, *others)]
        if self.sampled and k != sum(r.manifest.spec.targets.k for r in (reader, *others)):
            raise ValueError("an ensemble of sampled caches keeps every slot: k must be the sum of the caches' k")
        self.weights, self.ensemble_k = _checked_weights(weights, 1 + len(others)), k  # self.k: the first cache's
        self._others, self._local = others, threading.local()

    def make_batch(self, picked: list[tuple[int, int]]) -> Batch:
        windows = self.windows(picked)
        input_ids, target, mask = self.tokens(windows)  # as one cache reads them
        loss_rows, sampler_lp = self.completion_rows(windows, target)  # one corpus: the first cache's
        parts = [[] for _ in range(1 + len(self._others))]
        for (_, i), (shard, _, lo, hi) in zip(picked, windows):
            first = lo - int(shard.seq_offsets[np.searchsorted(shard.seq_offsets, lo, side="right") - 1])
            parts[0].append(shard.targets.slice(lo, hi))
            for part, lru in zip(parts[1:], self._other_lrus()):
                start, _, other = lru.sequence(i)
                part.append(other.targets.slice(start + first, start + first + hi - lo))
        joined = [TeacherTargets.concat(p) for p in parts]
        slot_weights = None
        if self.sampled:
            ids, logprobs, slot_weights = combine_sampled(
                [(t.topk_ids, t.topk_logprobs, target_weights(t, head)) for t, head in zip(joined, self._heads)],
                self.weights)
            tail = np.zeros(len(ids), np.float32)  # the sampled loss form reads no tail
        else:
            ids, logprobs, tail = combine_topk([(t.topk_ids, t.topk_logprobs, t.tail_logmass) for t in joined],
                                               self.weights, self.ensemble_k)
        with np.errstate(divide="ignore"):
            target_lp = np.log(sum(w * np.exp(t.target_logprob.astype(np.float64)) for w, t in zip(self.weights, joined)))
        rows, (B, L), k = mask.ravel(), input_ids.shape, self.ensemble_k
        full_ids = np.broadcast_to(np.arange(k, dtype=np.int64), (B * L, k)).copy()
        full_lp = np.zeros((B * L, k), np.float32)
        full_tail, full_target = np.zeros(B * L, np.float32), np.full(B * L, np.nan, np.float32)
        full_ids[rows], full_lp[rows], full_tail[rows], full_target[rows] = ids, logprobs, tail, target_lp
        full_weights = None
        if slot_weights is not None:
            full_weights = np.zeros((B * L, k), np.float32)
            full_weights[rows] = slot_weights
        batch = Batch(torch.from_numpy(input_ids), torch.from_numpy(full_ids), torch.from_numpy(full_lp),
                      torch.from_numpy(full_tail), torch.from_numpy(target.ravel()), torch.from_numpy(full_target),
                      torch.from_numpy(mask.ravel()), None if full_weights is None else torch.from_numpy(full_weights),
                      *(None if a is None else torch.from_numpy(a.ravel()) for a in (loss_rows, sampler_lp)))
        return batch.pin_memory() if self.pin else batch

    def _other_lrus(self) -> list[ShardLRU]:
        """The calling thread's shard caches of the other teachers' caches (readers of its own)."""
        lrus = getattr(self._local, "lrus", None)
        if lrus is None:
            lrus = self._local.lrus = [ShardLRU(CacheReader(r.path, verify_checksums=r.verify_checksums),
                                                self._lru_shards) for r in self._others]
        return lrus


def ensemble_width(readers: list[CacheReader], k: int | None) -> int:
    """The slots a row of the ensemble of `readers` holds: `k` (default: the largest cache's k) for top-k
    caches; every teacher's slots (sum of k) for sampled or hybrid ones, where `k` is refused."""
    if readers[0].manifest.spec.targets.sampled:
        if k is not None:
            raise DistillUserError("--ensemble-k: an ensemble of sampled caches keeps every drawn id (dropping one "
                                   "would bias the estimate); leave --ensemble-k out")
        return sum(r.manifest.spec.targets.k for r in readers)
    return k or max(r.manifest.spec.targets.k for r in readers)


def check_ensemble_kinds(first: CacheReader, other: CacheReader) -> None:
    """Refuse, in one line naming --ensemble, a top-k cache beside a sampled or hybrid one (module doc)."""
    if first.manifest.spec.targets.sampled != other.manifest.spec.targets.sampled:
        kinds = f"{first.path} holds {first.manifest.spec.targets.kind} targets, {other.path} " \
                f"{other.manifest.spec.targets.kind}"
        raise DistillUserError(f"--ensemble: {kinds}; a top-k cache's tail is one mass without ids, which the sampled "
                               "caches' unbiased loss drops, so top-k and sampled caches cannot be combined: ensemble "
                               "caches that are all top-k, or all sampled / topk+sampled")


def check_same_corpus(first: CacheReader, other: CacheReader) -> None:
    """Refuse, in one line naming --ensemble, a cache whose tokenizer or corpus is not `first`'s: the
    differing fingerprint and the first sequence whose tokens differ."""
    a, b = first.manifest.spec, other.manifest.spec
    if a.tokenizer.hash != b.tokenizer.hash:
        raise DistillUserError(f"--ensemble: {other.path} has tokenizer hash {b.tokenizer.hash}, {first.path} has "
                               f"{a.tokenizer.hash}; an ensemble's caches score one corpus with one tokenizer")
    if a.data.fingerprint == b.data.fingerprint and a.data.sequences == b.data.sequences:
        return
    where = f"{a.data.sequences} vs {b.data.sequences} sequences"
    starts = [np.cumsum([0] + [s.sequences for s in r.manifest.shards]) for r in (first, other)]
    for index in range(min(a.data.sequences, b.data.sequences)):
        x, y = (_tokens(reader, start, index) for reader, start in zip((first, other), starts))
        if not np.array_equal(x, y):
            where = f"first differing sequence {index}"
            break
    raise DistillUserError(f"--ensemble: {other.path} scored another corpus than {first.path} (data fingerprint "
                           f"{b.data.fingerprint} vs {a.data.fingerprint}; {where}); ensemble caches of one corpus")


def _tokens(reader: CacheReader, starts: np.ndarray, index: int) -> np.ndarray:
    shard_index = int(np.searchsorted(starts, index, side="right") - 1)
    shard = reader.load_shard(shard_index)
    local = index - int(starts[shard_index])
    return shard.input_ids[shard.seq_offsets[local]:shard.seq_offsets[local + 1]]
