"""Micro-batches in the student's tokens from a cache of another tokenizer.

The stream is CacheBatches' (the same order, windows, resume position, ranks' shares: the window is
cut in the teacher's tokens); each picked window is aligned (align.py), its aligned positions get
the teacher row's top-k + tail mapped onto the student's vocabulary (vocab_map.py), and the batch's
``kd_mask`` marks them. Rows between aligned positions have no teacher targets: they train on their
own next token (student/loss.py). ``target_logprob`` is NaN on every row (the teacher scored its own
tokens, not the student's).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from distill.errors import DistillUserError
from student.cross_tokenizer.align import Aligner, special_map, special_roles
from student.cross_tokenizer.vocab_map import VocabMap, cached_vocab_map, map_rows, pair_key
from student.data import Batch, CacheBatches
from teacher_cache.identity import tokenizer_info
from teacher_cache.token_bytes import token_pieces

MODES = ("auto", "off", "byte-prefix")


@dataclass
class CrossTokenizer:
    """Everything a cache of one tokenizer needs to teach a student of another."""

    aligner: Aligner
    vocab_map: VocabMap
    fillers: np.ndarray

    @staticmethod
    def between(teacher_tokenizer, student_tokenizer, *, maps_folder=None) -> CrossTokenizer:
        teacher, student = token_pieces(teacher_tokenizer, "cache"), token_pieces(student_tokenizer, "tokenizer")
        specials = special_map(teacher, special_roles(teacher_tokenizer), student, special_roles(student_tokenizer))
        teacher_hash, student_hash = tokenizer_info(teacher_tokenizer)["hash"], tokenizer_info(student_tokenizer)["hash"]
        if teacher_hash == student_hash:  # every id is itself (two ids of one spelling included)
            vmap = VocabMap(np.arange(len(teacher)), len(student))
        else:
            vmap = cached_vocab_map(teacher, student, specials, key=pair_key(teacher_hash, student_hash),
                                    folder=maps_folder)
        aligner = Aligner(teacher, special_roles(teacher_tokenizer), student, student_tokenizer,
                          same=teacher_hash == student_hash)
        return CrossTokenizer(aligner, vmap, vmap.fillers)


class CrossTokenizerBatches(CacheBatches):
    """CacheBatches whose batches are in the student's tokens (module doc). ``counts``: what alignment
    could not encode so far (align.Alignment.counts, summed) and ``aligned`` / ``positions``.
    Building a batch costs several times a plain one's, so Prefetcher builds these on
    ``prefetch_workers`` threads (the tokenizer and numpy's sorts run off the interpreter lock)."""

    prefetch_workers = max(1, min(6, (os.cpu_count() or 2) // 2))

    def __init__(self, reader, indices, batch_size: int, *, cross: CrossTokenizer, **kwargs):
        super().__init__(reader, indices, batch_size, **kwargs)
        if self.sampled:
            raise DistillUserError("--cross-tokenizer: a sampled cache cannot teach another tokenizer (its ids are "
                                   "draws, not a top-k); build a top-k cache (--targets topk)")
        self.cross = cross
        self.counts: Counter = Counter()
        self._counts_lock = threading.Lock()  # Prefetcher's workers build batches at once

    def make_batch(self, picked: list[tuple[int, int]]) -> Batch:
        windows = self.windows(picked)
        aligned = self.cross.aligner.align_many([shard.input_ids[lo:hi] for shard, _, lo, hi in windows])
        B, L, k = len(windows), max(max(len(a.student_ids) for a in aligned), 1), self.k
        input_ids = np.zeros((B, L), np.int64)
        topk_ids = np.broadcast_to(np.arange(k, dtype=np.int64), (B, L, k)).copy()
        topk_lp = np.zeros((B, L, k), np.float32)
        tail = np.zeros((B, L), np.float32)
        target = np.full((B, L), -1, np.int64)
        mask = np.zeros((B, L), bool)
        kd = np.zeros((B, L), bool)
        teacher_rows = []  # the aligned positions' cached rows, mapped at once below
        counts: Counter = Counter()
        for b, ((shard, _, lo, _), a) in enumerate(zip(windows, aligned)):
            m, t = len(a.student_ids), shard.targets
            input_ids[b, :m] = a.student_ids
            target[b, :m - 1] = a.student_ids[1:]
            mask[b, :m] = True
            at = np.flatnonzero(a.teacher_row >= 0)
            rows = lo + a.teacher_row[at]
            kd[b, at] = True
            teacher_rows.append((t.topk_ids[rows], t.topk_logprobs[rows], t.tail_logmass[rows]))
            counts.update(a.counts)
            counts["positions"] += m
            counts["aligned"] += len(at)
        if teacher_rows:
            topk_ids[kd], topk_lp[kd], tail[kd] = map_rows(self.cross.vocab_map,
                                                           *(np.concatenate(part) for part in zip(*teacher_rows)),
                                                           self.cross.fillers)
        with self._counts_lock:
            self.counts.update(counts)
        flat = lambda x: torch.from_numpy(x.reshape(B * L, *x.shape[2:]))
        batch = Batch(torch.from_numpy(input_ids), flat(topk_ids), flat(topk_lp), flat(tail), flat(target),
                      torch.full((B * L,), float("nan")), flat(mask), None, flat(kd))
        return batch.pin_memory() if self.pin else batch


def open_cross_tokenizer(reader, student_tokenizer, mode: str, *, maps_folder=None) -> CrossTokenizer | None:
    """What a student of `student_tokenizer` needs to learn from `reader`'s cache: None when it reads
    the cache as it is (the same tokenizer, and `mode` is not "byte-prefix"); refusals are one line
    naming the option (module doc of student/cross_tokenizer)."""
    from teacher_cache.tokenizer_files import load_cache_tokenizer

    if mode not in MODES:
        raise DistillUserError(f"--cross-tokenizer must be one of {', '.join(MODES)}, got {mode!r}")
    cache_tok = reader.manifest.spec.tokenizer
    same = tokenizer_info(student_tokenizer)["hash"] == cache_tok.hash
    if same and mode != "byte-prefix":
        return None
    if mode == "off":
        raise DistillUserError(f"--tokenizer: the cache {reader.path} was built with another tokenizer (hash "
                               f"{cache_tok.hash}); pass --cross-tokenizer auto to learn across tokenizers, or build "
                               "the cache with the student's tokenizer")
    teacher_tokenizer = load_cache_tokenizer(reader.path)
    if teacher_tokenizer is None:
        raise DistillUserError(f"--cache: {reader.path} holds no tokenizer files, so its ids cannot be read as text "
                               f"for another tokenizer; add them with `distill add-tokenizer {reader.path} "
                               "TEACHER_FOLDER`")
    cross = CrossTokenizer.between(teacher_tokenizer, student_tokenizer, maps_folder=maps_folder)
    _check_encodes(reader, cross)
    return cross


def _check_encodes(reader, cross: CrossTokenizer, sequences: int = 4) -> None:
    """Refuse a student tokenizer that shares no boundary with the teacher's on the cache's first sequences."""
    shard = reader.load_shard(0)
    aligned = positions = 0
    for i in range(min(sequences, len(shard.seq_offsets) - 1)):
        a = cross.aligner.align(shard.input_ids[shard.seq_offsets[i]:shard.seq_offsets[i + 1]])
        aligned, positions = aligned + int((a.teacher_row >= 0).sum()), positions + len(a.student_ids)
    if aligned == 0:
        raise DistillUserError(f"--tokenizer: the student's tokenizer shares no token boundary with the cache's on its "
                               f"first sequences ({positions} student tokens); it cannot encode this text: use another "
                               "tokenizer")


def batches_for(cross: CrossTokenizer | None):
    """The batch stream class to read a cache with: CacheBatches, or with `cross` this module's."""
    if cross is None:
        return CacheBatches
    return lambda *args, **kwargs: CrossTokenizerBatches(*args, cross=cross, **kwargs)
