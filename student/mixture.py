"""Micro-batches from several caches at once: a data mixture in fixed shares.

Each cache has its own stream (a ``CacheBatches``, or a cross-tokenizer one), seeded by the run's
seed and the cache's place in the list (the first cache's stream is exactly the one a one-cache run
reads). The sequences of the batches go to the caches by smooth weighted round-robin: the n-th
sequence of the run goes to the cache i whose deficit w_i (n + 1) - taken_i is largest (the first
on a tie), so after any n sequences every cache has supplied its share w_i n to within one sequence,
with no randomness to seed and nothing to draw on resume. The position is the streams' positions
and the counts taken: ``state_dict`` / ``load_state_dict`` resume exactly there.

A batch holds each cache's sequences in the caches' order, padded to the longest: the caches must
give rows of one shape and meaning, so ``open_caches`` refuses caches of another tokenizer, k or
temperature than the first's, in one line naming --cache, before any work. Sampled and hybrid
(topk+sampled) caches mix with each other: each row is an unbiased estimate of its own teacher's
distribution, and every row's loss is that estimate. A top-k cache does not mix with them: one
batch has one loss form, and the sampled caches' ("unnormalized") drops a top-k row's tail mass.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from distill.errors import DistillUserError
from student.cross_tokenizer.batches import CrossTokenizer, batches_for, open_cross_tokenizer
from student.data import Batch, CacheBatches, split_indices
from student.ensemble import EnsembleBatches, check_ensemble_kinds, check_same_corpus, ensemble_width
from student.evaluate import EvalResult
from teacher_cache.reader import CacheReader


@dataclass
class CacheSource:
    """One cache of a run: its reader, what a student of another tokenizer needs to read it (None:
    the student's tokenizer is the cache's), and its training and evaluation sequences."""

    reader: CacheReader
    cross: CrossTokenizer | None
    train_idx: list[int]
    eval_idx: list[int]

    @property
    def batches(self):
        """The batch stream class of this cache (student.cross_tokenizer.batches.batches_for)."""
        return batches_for(self.cross)


def open_caches(caches, student_tokenizer, *, cross_tokenizer: str, heldout: int, eval_sequences: int | None,
                maps_folder=None, ensemble: bool = False) -> list[CacheSource]:
    """A CacheSource for each of `caches` (paths or URLs), its held-out split `heldout` sequences of
    its own (evaluations use the first `eval_sequences`), after refusing a cache that cannot be
    mixed with the first (module doc), or with `ensemble` one that did not score the first's corpus
    at its temperature (student/ensemble.py)."""
    sources = []
    for path in caches:
        reader = CacheReader(path)
        if sources and ensemble:
            check_same_corpus(sources[0].reader, reader)
            check_ensemble_kinds(sources[0].reader, reader)
            first, temperature = sources[0].reader, reader.manifest.spec.targets.temperature
            if temperature != first.manifest.spec.targets.temperature:
                raise DistillUserError(f"--ensemble: {reader.path} has temperature {temperature}, {first.path} has "
                                       f"{first.manifest.spec.targets.temperature}; ensemble caches of one temperature")
        elif sources:
            _check_mixable(sources[0].reader, reader)
        cross = open_cross_tokenizer(reader, student_tokenizer, cross_tokenizer, maps_folder=maps_folder)
        if cross is not None and reader.manifest.spec.data.generated is not None:
            raise DistillUserError(f"--cache: {reader.path} scored text a policy wrote, whose loss rows are the "
                                   "policy's tokens; a student of another tokenizer cannot learn from it")
        if ensemble and cross is not None:
            raise DistillUserError("--ensemble: a student of another tokenizer than the caches' cannot learn from an "
                                   "ensemble yet; use one --cache")
        train_idx, held_idx = split_indices(reader.num_sequences, heldout)
        sources.append(CacheSource(reader, cross, train_idx, held_idx[:eval_sequences] if eval_sequences else held_idx))
    return sources


def _check_mixable(first: CacheReader, other: CacheReader) -> None:
    a, b = first.manifest.spec, other.manifest.spec
    if a.targets.sampled != b.targets.sampled:
        raise DistillUserError(
            f"--cache: {other.path} holds {b.targets.kind} targets, the first cache {first.path} {a.targets.kind}; "
            "a top-k cache and a sampled one cannot share a run: the sampled caches' unbiased loss form drops a top-k "
            "row's tail mass (a biased objective), so mix caches that are all top-k, or all sampled / topk+sampled")
    differs = [(what, x, y) for what, x, y in (
        ("tokenizer hash", a.tokenizer.hash, b.tokenizer.hash), ("k", a.targets.k, b.targets.k),
        ("temperature", a.targets.temperature, b.targets.temperature)) if x != y]
    if differs:
        what, x, y = differs[0]
        raise DistillUserError(f"--cache: {other.path} has {what} {y}, the first cache {first.path} has {x}; the caches "
                               "of one run must share the tokenizer, k (a sampled cache's slots) and the temperature")


@dataclass
class RunCaches:
    """What a run learns from: one cache, a mixture of several (`weights`: each one's share of the
    sequences) or an ensemble (`weights`: each teacher's in the mixture target, `ensemble_k` ids a
    position kept)."""

    sources: list[CacheSource]
    weights: list[float]
    ensemble_k: int | None = None  # None: not an ensemble

    @property
    def first(self) -> CacheSource:
        """The first cache: the run's identity and temperature (the others share them), an ensemble's text."""
        return self.sources[0]

    def stream(self, batch_size: int, *, seq_len: int | None, seed: int, pin_memory: bool, part: tuple[int, int],
               lru_shards: int):
        """The training batches: one cache's CacheBatches as a one-cache run reads them, an ensemble's
        (EnsembleBatches), or a MixtureBatches over every cache's stream. Each stream reads through
        readers of its own (batches are built on background threads while evaluation reads through
        the sources'), each keeping `lru_shards` decoded shards (--loader-shards)."""
        own = lambda source: CacheReader(source.reader.path)
        kwargs = dict(seq_len=seq_len, seed=seed, pin_memory=pin_memory, part=part, lru_shards=lru_shards)
        if self.ensemble_k is not None:
            mixture = ensemble_batches([own(s) for s in self.sources[1:]], self.weights, self.ensemble_k)
            return mixture(own(self.first), self.first.train_idx, batch_size, **kwargs)
        if len(self.sources) == 1:
            return self.first.batches(own(self.first), self.first.train_idx, batch_size, **kwargs)
        streams = [source.batches(own(source), source.train_idx, 1, seq_len=seq_len, seed=stream_seed(seed, place),
                                  lru_shards=lru_shards)
                   for place, source in enumerate(self.sources)]
        return MixtureBatches(streams, self.weights, batch_size, part=part, pin_memory=pin_memory)

    def evaluate(self, on) -> tuple[EvalResult, list[EvalResult]]:
        """(the run's evaluation, each cache's when several), from on(source, batch stream class)
        evaluating the student on a cache's held-out sequences: an ensemble's against the teachers'
        mixture, else the caches' mean at the weights."""
        each = [on(source, source.batches) for source in self.sources]
        return self._combined(on, each), each if len(each) > 1 else []

    def teacher(self, reference) -> tuple[EvalResult, list[EvalResult]]:
        """(the teacher's reference, each cache's teacher) as `evaluate`, from reference(source, batch
        stream class) reading a cache's own targets (student/evaluate.teacher_reference)."""
        each = [reference(source, CacheBatches) for source in self.sources]
        return self._combined(reference, each), each

    def _combined(self, on, each: list[EvalResult]) -> EvalResult:
        if self.ensemble_k is not None:
            return on(self.first, ensemble_batches([s.reader for s in self.sources[1:]], self.weights, self.ensemble_k))
        return each[0] if len(each) == 1 else EvalResult.mixed(each, self.weights)


def open_run_caches(config, student_tokenizer, *, maps_folder=None) -> RunCaches:
    """The caches of TrainConfig `config` (its --cache list, or its --ensemble), checked (open_caches),
    with their weights."""
    sources = open_caches(config.ensemble or config.cache, student_tokenizer, cross_tokenizer=config.cross_tokenizer,
                          heldout=config.heldout, eval_sequences=config.eval_sequences, maps_folder=maps_folder,
                          ensemble=bool(config.ensemble))
    given = config.ensemble_weights if config.ensemble else config.cache_weights
    weights = normalized_weights(given or [1.0] * len(sources), len(sources),
                                 "--ensemble-weights" if config.ensemble else "--cache-weights")
    ensemble_k = ensemble_width([s.reader for s in sources], config.ensemble_k) if config.ensemble else None
    if config.loss.objective == "reverse_kl" and all(s.reader.manifest.spec.data.generated is None for s in sources):
        raise DistillUserError("--objective reverse_kl learns from the student's own samples: give a --cache that "
                               "cache-teacher scored from `distill generate` output, or leave --objective out")
    return RunCaches(sources, weights, ensemble_k)


def stream_seed(seed: int, place: int) -> int:
    """The seed of the stream of the cache at `place` in the list: the run's seed for the first."""
    return seed if place == 0 else int(np.random.default_rng([seed, place]).integers(2**31))


def normalized_weights(weights, caches: int, option: str = "--cache-weights") -> list[float]:
    """`weights` (one per cache, >= 0, a positive sum) scaled to sum 1, or a one-line error naming `option`."""
    weights = [float(w) for w in weights]
    if len(weights) != caches:
        raise DistillUserError(f"{option}: {len(weights)} weight(s) for {caches} cache(s); give one weight per cache")
    if any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise DistillUserError(f"{option}: weights must be finite, >= 0 and sum to a positive number, got "
                               f"{','.join(f'{w:g}' for w in weights)}")
    total = sum(weights)
    return [w / total for w in weights]


def cat_batches(batches: list[Batch]) -> Batch:
    """One batch of the sequences of `batches` in their order, padded to the longest. An optional
    field that only some hold is filled for the others as it reads there: kd_mask (every unmasked
    row has targets), sampler_logprob (NaN: no sampler), target_weights (refused: a sampled cache
    mixes only with sampled ones)."""
    if len(batches) == 1:
        return batches[0]
    length = max(b.input_ids.shape[1] for b in batches)
    padded = [b.padded_to(length) for b in batches]
    if len({b.target_weights is None for b in padded}) > 1:
        raise DistillUserError("--cache: a sampled cache mixes only with sampled caches (their slots are weighted "
                               "draws, a top-k cache's are exact probabilities); mix caches of one kind")
    fill = {"kd_mask": lambda b: b.mask.clone(), "sampler_logprob": lambda b: torch.full_like(b.tail_logmass, math.nan)}
    fields = {}
    for f in dataclasses.fields(Batch):
        values = [getattr(b, f.name) for b in padded]
        if f.name in fill and any(v is not None for v in values):
            values = [fill[f.name](b) if v is None else v for b, v in zip(padded, values)]
        fields[f.name] = None if values[0] is None else torch.cat(values)
    return Batch(**fields)


def ensemble_batches(others: list[CacheReader], weights, k: int):
    """The batch stream class of an ensemble over the first teacher's cache (as CacheBatches is called)."""
    return lambda reader, indices, batch_size, **kwargs: EnsembleBatches(reader, indices, batch_size, others=others,
                                                                         weights=weights, k=k, **kwargs)


class MixtureBatches:
    """Endless micro-batches of `batch_size` sequences drawn from `streams` in the shares `weights`
    (module doc). Each stream must have been built with batch_size 1, no `part` and unpinned: the
    mixture picks the batch, gives rank `part[0]` of `part[1]` its contiguous share, as CacheBatches
    does, and pins the joined batch when `pin_memory`."""

    def __init__(self, streams: list[CacheBatches], weights, batch_size: int, *, part: tuple[int, int] = (0, 1),
                 pin_memory: bool = False):
        if any(s.batch_size != 1 or s.part != (0, 1) or s.pin for s in streams):
            raise ValueError("each stream of a mixture reads one sequence at a time, for the whole batch, unpinned")
        rank, world_size = part
        if not 0 <= rank < world_size or batch_size % world_size:
            raise DistillUserError(f"`part` must be (rank, world_size) with world_size dividing batch_size "
                                   f"{batch_size}, got {part}")
        self.streams, self.weights = streams, normalized_weights(weights, len(streams))
        self.batch_size, self.part, self.pin = batch_size, part, pin_memory
        self.taken = [0] * len(streams)
        self._picks = [s.picks() for s in streams]
        self.prefetch_workers = max(s.prefetch_workers for s in streams)

    @property
    def epoch(self) -> int:
        """The first cache's epoch (passes over its training sequences)."""
        return self.streams[0].epoch

    @property
    def counts(self) -> Counter:
        """A cross-tokenizer student's alignment counts, summed over the caches' streams."""
        return sum((stream.counts for stream in self.streams), Counter())

    def state_dict(self) -> dict:
        return {"streams": [s.state_dict() for s in self.streams], "taken": list(self.taken),
                "weights": list(self.weights)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["streams"]) != len(self.streams) or not np.allclose(state["weights"], self.weights, rtol=0,
                                                                         atol=1e-12):
            raise DistillUserError(f"saved data position is for {len(state['streams'])} caches at weights "
                                   f"{state['weights']}, this run has {len(self.streams)} at {self.weights}; use a "
                                   "fresh run directory")
        for stream, saved in zip(self.streams, state["streams"]):
            stream.load_state_dict(saved)
        self.taken = [int(t) for t in state["taken"]]

    def next_cache(self) -> int:
        """The cache the run's next sequence comes from (module doc); counts it as taken."""
        n = sum(self.taken)
        deficits = [w * (n + 1) - t for w, t in zip(self.weights, self.taken)]
        i = int(np.argmax(deficits))
        self.taken[i] += 1
        return i

    def picks(self):
        """Endless: each next batch's (cache, epoch, sequence index) triples, this rank's share, the
        position advanced past them; `make_batch` builds the batch."""
        while True:
            picked = []
            for _ in range(self.batch_size):
                i = self.next_cache()
                (epoch, index), = next(self._picks[i])
                picked.append((i, epoch, index))
            picked.sort(key=lambda p: p[0])  # stable: each cache's sequences in their drawn order
            rank, share = self.part[0], self.batch_size // self.part[1]
            yield picked[rank * share:(rank + 1) * share]

    def __iter__(self):
        for picked in self.picks():
            yield self.make_batch(picked)

    def make_batch(self, picked) -> Batch:
        parts = []
        for i, stream in enumerate(self.streams):
            mine = [(epoch, index) for cache, epoch, index in picked if cache == i]
            if mine:
                parts.append(stream.make_batch(mine))
        batch = cat_batches(parts)
        return batch.pin_memory() if self.pin else batch
