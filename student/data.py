"""Micro-batches of cached teacher targets for the student: a held-out split and a seeded,
resumable stream over a ``CacheReader``.

Row convention (cache format v1): row t of a sequence holds the teacher's distribution over token
t + 1. A batch flattens [B, L] positions to B * L rows; padded rows (ragged sequences) have
``mask`` False and harmless values (ids 0..k-1, log-probs 0, target weights 0).

From a sampled cache (RS-KD; ``reader.manifest.spec.targets.kind == "sampled"``) a batch also
carries ``target_weights``, the weight of each slot in the unbiased estimate of the full KL:
w_j = (c_j / S) * exp(l_j - log r(u_j)), which is c_j / S when the proposal r is the teacher p
(CONTRACT: E[w at id v] = p(v)). Padding slots (count 0) and padding rows weigh 0.

A cache of generated text (`distill generate`, then stage one; teacher_cache/store.py) trains only
on the rows whose next token the policy wrote: on the prompt's rows ``target_ids`` is -1 and
``kd_mask`` False, so neither the KL nor the cross-entropy touches them, while the prompt's tokens
stay the context; ``sampler_logprob`` carries the sampler's log-probability of each completion
token, for the reverse-KL objective's importance ratio.

A hybrid cache (targets.kind "topk+sampled") weighs its exact top-K slots p_j = exp(l_j) and its
drawn slots as above, r being the proposal restricted to the ids outside the top-K and
renormalised: (c_j / S) (1 - P_K) when r is the teacher (1 - P_K = exp(tail_logmass)). The top-K
part sums to P_K, the drawn part to 1 - P_K (exactly when r is the teacher, else in expectation).
"""

from __future__ import annotations

import bisect
import dataclasses
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from distill.configs import require
from distill.errors import DistillUserError
from student.host_threads import run_serially_here
from teacher_cache.reader import CacheReader


def load_tokenizer(folder):
    """The HF tokenizer in `folder`, or a one-line error naming --tokenizer."""
    from transformers import AutoTokenizer  # seconds to import; only loading a tokenizer needs it

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        raise DistillUserError(f"--tokenizer: cannot load a tokenizer from {folder} ({type(e).__name__}); give a "
                               "folder with tokenizer.json / tokenizer_config.json") from None


def split_indices(num_sequences: int, heldout: int) -> tuple[list[int], list[int]]:
    """(train, heldout) sequence indices; the `heldout` held-out ones are evenly spaced over the
    cache, so the split depends only on the two counts (never on a seed)."""
    ok = isinstance(heldout, int) and not isinstance(heldout, bool) and 0 <= heldout < num_sequences
    require("heldout", heldout, ok, f"an integer in [0, {num_sequences - 1}] (the cache has {num_sequences} "
                                    "sequences and at least one must stay for training)")
    held = sorted({(2 * i + 1) * num_sequences // (2 * heldout) for i in range(heldout)})
    held_set = set(held)
    return [i for i in range(num_sequences) if i not in held_set], held


@dataclass
class Batch:
    """One micro-batch; B sequences padded to L positions, flattened to N = B * L rows."""

    input_ids: torch.Tensor  # int64 [B, L]
    topk_ids: torch.Tensor  # int64 [N, k]
    topk_logprobs: torch.Tensor  # float32 [N, k], full-vocabulary teacher log-probs
    tail_logmass: torch.Tensor  # float32 [N]
    target_ids: torch.Tensor  # int64 [N], the next input id; -1 on each sequence's last row and padding
    target_logprob: torch.Tensor  # float32 [N], teacher log-prob of target_ids (NaN where none)
    mask: torch.Tensor  # bool [N], False on padding rows
    # float32 [N, k], a sampled or hybrid cache's slot weights (module doc; 0 on padding); None: a top-k cache
    target_weights: torch.Tensor | None = None
    # bool [N], the rows that have teacher targets (a cross-tokenizer student's aligned positions,
    # student/cross_tokenizer/; a cache of generated text's completion rows); None: every unmasked row
    kd_mask: torch.Tensor | None = None
    # float32 [N], a cache of generated text's: the sampler's log-prob of the next token on its
    # completion rows, NaN elsewhere (module doc); None: another cache
    sampler_logprob: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def kd_rows(self) -> torch.Tensor:
        """bool [N]: the rows the KL term is measured on."""
        return self.mask if self.kd_mask is None else self.mask & self.kd_mask

    def _map(self, fn) -> "Batch":
        """Every tensor through ``fn``; None stays None."""
        return Batch(**{k: None if v is None else fn(v) for k, v in vars(self).items()})

    def to(self, device, non_blocking: bool = False) -> "Batch":
        return self._map(lambda v: v.to(device, non_blocking=non_blocking))

    def positions(self, start: int, end: int) -> "Batch":
        """The rows of positions start..end of every sequence: a batch of B * (end - start) rows."""
        B, L = self.input_ids.shape
        rows = lambda t: t.view(B, L, *t.shape[1:])[:, start:end].reshape(B * (end - start), *t.shape[1:])
        return Batch(self.input_ids[:, start:end], *(None if getattr(self, f.name) is None else rows(getattr(self, f.name))
                                                     for f in dataclasses.fields(self)[1:]))

    def padded_to(self, length: int) -> "Batch":
        """Every sequence padded to `length` positions, the padding as CacheBatches makes it."""
        B, L = self.input_ids.shape
        if length == L:
            return self
        k, extra = self.topk_ids.shape[1], length - L
        pad = lambda t_BL, fill: torch.cat([t_BL, fill.expand(B, extra, *t_BL.shape[2:]).to(t_BL.dtype)], 1)
        rows = lambda t, fill: pad(t.view(B, L, *t.shape[1:]), fill).reshape(B * length, *t.shape[1:])
        scalar = lambda value: torch.tensor([[value]])
        optional = lambda t, fill: None if t is None else rows(t, scalar(fill))
        return Batch(pad(self.input_ids, scalar(0)), rows(self.topk_ids, torch.arange(k).view(1, 1, k)),
                     rows(self.topk_logprobs, scalar(0.0)), rows(self.tail_logmass, scalar(0.0)),
                     rows(self.target_ids, scalar(-1)), rows(self.target_logprob, scalar(float("nan"))),
                     rows(self.mask, scalar(False)), optional(self.target_weights, 0.0), optional(self.kd_mask, False),
                     optional(self.sampler_logprob, float("nan")))

    def pin_memory(self) -> "Batch":
        return self._map(lambda v: v.pin_memory())


def target_weights(targets, head: int = 0) -> np.ndarray:
    """float32 [N, k]: the slot weights of sampled targets (``TeacherTargets`` with sample_counts),
    w_j = (c_j / S) * exp(l_j - log r(u_j)), or c_j / S when no proposal log-probs are stored.
    head: a hybrid cache's exact top-K slots at the front of each row (targets.head), weighted
    exp(l_j); the drawn slots' c_j / S is then scaled by 1 - P_K = exp(tail_logmass) when no
    proposal log-probs are stored (module doc)."""
    counts = targets.sample_counts.astype(np.float64)
    weights = counts / counts.sum(axis=1, keepdims=True)
    logprobs = targets.topk_logprobs.astype(np.float64)
    if targets.proposal_logprobs is not None:
        ratio = logprobs - targets.proposal_logprobs.astype(np.float64)
        weights *= np.exp(np.where(counts > 0, ratio, 0.0))  # padding: weight 0, whatever its log-probs
    elif head:
        weights *= np.exp(targets.tail_logmass.astype(np.float64))[:, None]
    if head:
        weights[:, :head] = np.exp(logprobs[:, :head])
    return weights.astype(np.float32)


class ShardLRU:
    """The last few decoded shards of a reader (the reader itself keeps one): with shards in a
    shuffled order and an evaluation pass in between, each shard is still decoded about once."""

    def __init__(self, reader: CacheReader, size: int):
        self.reader, self.size = reader, size
        self.shards: OrderedDict[int, object] = OrderedDict()
        self.starts = np.cumsum([0] + [s.sequences for s in reader.manifest.shards]).tolist()

    def shard_of(self, i: int) -> int:
        return bisect.bisect_right(self.starts, i) - 1

    def sequence(self, i: int):
        """(start, stop, shard): sequence i is rows start:stop of the decoded shard's arrays."""
        index = self.shard_of(i)
        shard = self.shards.pop(index, None)
        if shard is None:
            shard = self.reader.load_shard(index)
        self.shards[index] = shard
        while len(self.shards) > self.size:
            self.shards.popitem(last=False)
        local = i - self.starts[index]
        start, stop = int(shard.seq_offsets[local]), int(shard.seq_offsets[local + 1])
        return start, stop, shard

    def peak_bytes(self, indices) -> int:
        """The most host memory this cache of decoded shards takes while reading `indices`, once it
        has decoded one: holding as many decoded shards as it keeps (the largest of those the indices
        lie in), it reads and decodes one more, which takes the shard's file bytes and twice its
        decoded bytes (Arrow's column buffers, then the arrays; notes/long-context.md,
        "What the loader holds"). A shard's decoded bytes are its rows' and its sequence offsets',
        a row's bytes those of a shard it holds."""
        assert self.shards, "decode a shard first (read a sequence)"
        held = next(iter(self.shards.values()))
        row = sum(a.nbytes for a in (held.input_ids, *held.targets.arrays, held.loss_mask, held.sampler_logprob)
                  if a is not None) // len(held.input_ids)
        decoded = lambda info: info.tokens * row + (info.sequences + 1) * held.seq_offsets.itemsize
        infos = sorted((self.reader.manifest.shards[s] for s in {self.shard_of(i) for i in indices}),
                       key=lambda info: info.tokens, reverse=True)
        return sum(map(decoded, infos[1:self.size + 1])) + infos[0].bytes + 2 * decoded(infos[0])


class CacheBatches:
    """Endless micro-batches of `batch_size` sequences from `indices` of `reader`.

    Each epoch visits every index once, in an order seeded by (seed, epoch): shards shuffled, then
    sequences within each shard shuffled, so one decoded shard serves many batches. A batch may
    span the end of one epoch and the start of the next. `seq_len` crops longer sequences to a
    window: at a seeded random start when `shuffle`, else the first `seq_len` positions. The
    position (epoch, offset) is `state_dict()`; `load_state_dict` resumes exactly there.
    With shuffle=False the order is `indices` as given and `epoch_batches()` yields one pass.
    part=(rank, world_size): the stream visits the same sequences in the same order for every rank
    (its position is the same), but each batch holds only the rank's contiguous share of the
    `batch_size` picked, which must divide by world_size (student/distributed.py).
    """

    prefetch_workers = 1  # threads Prefetcher builds these batches on: decoding a shard is the cost, and one keeps up

    def __init__(self, reader: CacheReader, indices, batch_size: int, *, seq_len: int | None = None,
                 seed: int = 0, shuffle: bool = True, pin_memory: bool = False, lru_shards: int = 4,
                 part: tuple[int, int] = (0, 1)):
        if batch_size < 1:
            raise DistillUserError(f"`batch_size` must be >= 1, got {batch_size}")
        if seq_len is not None and seq_len < 2:
            raise DistillUserError(f"`seq_len` must be >= 2 or None, got {seq_len}")
        rank, world_size = part
        if not 0 <= rank < world_size or batch_size % world_size:
            raise DistillUserError(f"`part` must be (rank, world_size) with 0 <= rank < world_size dividing "
                                   f"batch_size {batch_size}, got {part}")
        self.part = part
        self.indices = [int(i) for i in indices]
        if not self.indices:
            raise DistillUserError("no sequences to read: the index list is empty (is `heldout` the whole cache?)")
        self.reader, self.batch_size, self.seq_len = reader, batch_size, seq_len
        self.seed, self.shuffle, self.pin = seed, shuffle, pin_memory
        self.k = reader.manifest.spec.targets.k
        self.sampled = reader.manifest.spec.targets.sampled
        self.head = reader.manifest.spec.targets.head  # a hybrid cache's exact top-K slots per row
        self._lru = ShardLRU(reader, lru_shards)
        # per thread (Prefetcher's workers): the given reader's cache goes to the first thread that asks
        self._lru_shards, self._threads, self._spare_lru = lru_shards, threading.local(), [self._lru]
        self.epoch, self.offset = 0, 0
        self._order_epoch, self._order = None, None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_indices": len(self.indices)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_indices"] != len(self.indices) or state["seed"] != self.seed:
            raise DistillUserError(
                f"saved data position is for {state['num_indices']} sequences with seed {state['seed']}, "
                f"this run has {len(self.indices)} with seed {self.seed}; use a fresh run directory"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return self.indices
        if self._order_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            by_shard: dict[int, list[int]] = {}
            for i in self.indices:
                by_shard.setdefault(self._lru.shard_of(i), []).append(i)
            order = []
            for shard in rng.permutation(sorted(by_shard)):
                order.extend(rng.permutation(by_shard[int(shard)]).tolist())
            self._order_epoch, self._order = epoch, order
        return self._order

    def __iter__(self):
        for picked in self.picks():
            yield self.make_batch(picked)

    def picks(self):
        """Endless: the (epoch, sequence index) pairs of each next batch (this rank's share), the
        position advanced past them; `make_batch` builds the batch (Prefetcher does it on workers)."""
        while True:
            picked = []
            while len(picked) < self.batch_size:
                order = self.epoch_order(self.epoch)
                take = order[self.offset:self.offset + self.batch_size - len(picked)]
                picked += [(self.epoch, i) for i in take]
                self.offset += len(take)
                if self.offset == len(order):
                    self.epoch, self.offset = self.epoch + 1, 0
            rank, share = self.part[0], self.batch_size // self.part[1]
            yield picked[rank * share:(rank + 1) * share]

    def host_bytes(self, batch: Batch, block=lambda n: n, streams: int = 1) -> int:
        """The most host memory a Prefetcher over this stream takes (the planner counts it), once a
        batch has been built: its `Prefetcher.most_held` built batches like `batch`, each tensor
        taking `block(its bytes)` (a GPU's pinned blocks), and each worker thread's shard cache
        (`ShardLRU.peak_bytes`), of `streams` streams alike (a mixture's or an ensemble's caches,
        each read by a stream of its own)."""
        batches = Prefetcher.most_held(self.prefetch_workers) * sum(block(t.nbytes) for t in vars(batch).values()
                                                                   if t is not None)
        return batches + streams * self.prefetch_workers * self._thread_lru().peak_bytes(self.indices)

    def epoch_batches(self):
        """One pass over `indices` in their order (the last batch may be smaller): for evaluation."""
        for lo in range(0, len(self.indices), self.batch_size):
            yield self.make_batch([(0, i) for i in self.indices[lo:lo + self.batch_size]])

    def _window(self, epoch: int, i: int, length: int) -> tuple[int, int]:
        if self.seq_len is None or length <= self.seq_len:
            return 0, length
        start = 0
        if self.shuffle:
            start = int(np.random.default_rng([self.seed, epoch, i]).integers(length - self.seq_len + 1))
        return start, start + self.seq_len

    def windows(self, picked: list[tuple[int, int]]) -> list[tuple]:
        """(decoded shard, the sequence's end row, window start row, window end row) of each picked
        (epoch, sequence index)."""
        rows = []
        for epoch, i in picked:
            start, stop, shard = self._thread_lru().sequence(i)
            lo, hi = self._window(epoch, i, stop - start)
            rows.append((shard, stop, start + lo, start + hi))
        return rows

    def _thread_lru(self) -> ShardLRU:
        """The shard cache of the calling thread: Prefetcher's workers build batches at once, each
        through a reader of its own (the first thread to ask uses the one given)."""
        lru = getattr(self._threads, "lru", None)
        if lru is None:
            try:
                lru = self._spare_lru.pop()  # atomic: one thread gets it
            except IndexError:
                lru = ShardLRU(CacheReader(self.reader.path, verify_checksums=self.reader.verify_checksums),
                                self._lru_shards)
            self._threads.lru = lru
        return lru

    @staticmethod
    def tokens(rows: list[tuple]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, next ids (-1: none), mask), each [B, L], of the `windows` rows, padded to the longest."""
        B, L = len(rows), max(hi - lo for _, _, lo, hi in rows)
        input_ids, target, mask = np.zeros((B, L), np.int64), np.full((B, L), -1, np.int64), np.zeros((B, L), bool)
        for b, (shard, seq_stop, lo, hi) in enumerate(rows):
            input_ids[b, :hi - lo] = shard.input_ids[lo:hi]
            # The window's last row still has a next token unless the sequence ends there.
            nxt = shard.input_ids[lo + 1:min(hi + 1, seq_stop)]
            target[b, :len(nxt)] = nxt
            mask[b, :hi - lo] = True
        return input_ids, target, mask

    @staticmethod
    def completion_rows(rows: list[tuple], target: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """A cache of generated text's (kd_mask, sampler_logprob), each [B, L], of the `windows` rows,
        with `target` [B, L] set to -1 on the prompt's rows (module doc); (None, None) for another cache."""
        if rows[0][0].loss_mask is None:
            return None, None
        loss, sampler = np.zeros(target.shape, bool), np.full(target.shape, np.nan, np.float32)
        for b, (shard, _, lo, hi) in enumerate(rows):
            loss[b, :hi - lo] = shard.loss_mask[lo:hi]
            sampler[b, :hi - lo] = shard.sampler_logprob[lo:hi]
        target[~loss] = -1
        return loss, sampler

    def make_batch(self, picked: list[tuple[int, int]]) -> Batch:
        rows = self.windows(picked)
        input_ids, target, mask = self.tokens(rows)
        loss_rows, sampler_lp = self.completion_rows(rows, target)
        (B, L), k = input_ids.shape, self.k
        topk_ids = np.broadcast_to(np.arange(k, dtype=np.int64), (B, L, k)).copy()
        topk_lp = np.zeros((B, L, k), np.float32)
        tail = np.zeros((B, L), np.float32)
        target_lp = np.full((B, L), np.nan, np.float32)
        weights = np.zeros((B, L, k), np.float32) if self.sampled else None
        for b, (shard, _, lo, hi) in enumerate(rows):
            n, t = hi - lo, shard.targets
            topk_ids[b, :n] = t.topk_ids[lo:hi]
            topk_lp[b, :n] = t.topk_logprobs[lo:hi]
            if weights is not None:
                weights[b, :n] = target_weights(t.slice(lo, hi), self.head)
            tail[b, :n] = t.tail_logmass[lo:hi]
            target_lp[b, :n] = t.target_logprob[lo:hi]
        flat = lambda a: torch.from_numpy(a.reshape(B * L, *a.shape[2:]))
        optional = lambda a: None if a is None else flat(a)
        batch = Batch(torch.from_numpy(input_ids), flat(topk_ids), flat(topk_lp), flat(tail), flat(target),
                      flat(target_lp), flat(mask), optional(weights), optional(loss_rows), optional(sampler_lp))
        return batch.pin_memory() if self.pin else batch


class Prefetcher:
    """The batches of a ``CacheBatches``, built ``depth`` ahead by ``workers`` background threads
    (default: the batches' ``prefetch_workers``), so that decoding, collating and pinning overlap the
    model's work. A feeder thread takes each next batch's sequences in order (``CacheBatches.picks``)
    and a worker builds it (``make_batch``); batches come out in their order whatever finishes first.

    ``state_dict()`` is the data position after the last batch handed out (not after the last one
    built), so a checkpoint resumes exactly at the next batch. Give the ``CacheBatches`` a reader of
    its own: the threads read through it (each worker through a copy) while the caller may evaluate
    through another.
    """

    depth = 2  # batches built ahead beyond the workers' own

    def __init__(self, batches: CacheBatches, depth: int | None = None, workers: int | None = None):
        depth = self.depth if depth is None else depth
        self._batches = batches
        self._state, self.epoch = batches.state_dict(), batches.epoch
        workers = workers or batches.prefetch_workers
        # the workers pin batches: alone, not in OpenMP teams of their own (student/host_threads.py)
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="distill-batch", initializer=run_serially_here)
        self._queue: queue.Queue = queue.Queue(maxsize=depth + workers - 1)  # every worker busy, depth ready
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="distill-prefetch", daemon=True)
        self._thread.start()

    @classmethod
    def most_held(cls, workers: int, depth: int | None = None) -> int:
        """The most built batches alive at once (the planner counts their host memory): the queue's
        depth + workers - 1, the one the feeder waits to put, the one the consumer took last, and
        the one before it, which a consumer's `batch = next(...)` holds until the next is handed over."""
        return (cls.depth if depth is None else depth) + workers + 2

    def _fill(self) -> None:
        try:
            for picked in self._batches.picks():  # the generator has advanced the position past them
                item = (self._workers.submit(self._batches.make_batch, picked), self._batches.state_dict(),
                        self._batches.epoch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # handed to the consumer, raised there
            self._queue.put((e, None, None))

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        pending, state, epoch = self._queue.get()
        if isinstance(pending, BaseException):
            raise pending
        batch = pending.result()  # a worker's error is raised here
        self._state, self.epoch = state, epoch
        return batch

    def state_dict(self) -> dict:
        return dict(self._state)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._workers.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
