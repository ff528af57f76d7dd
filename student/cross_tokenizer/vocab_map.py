"""The teacher's cached top-k + tail as a distribution over the student's vocabulary.

Byte-prefix marginalization (arXiv 2607.22334): at an aligned position (align.py) the teacher's
next token v begins with the bytes of exactly one longest student token s(v), the one the student
would predict next if the text continued with v's bytes; v's probability goes to s(v). Teacher
special ids go to the student's (align.special_map). A teacher id whose bytes no student token
begins (or a special the student lacks) maps nowhere: its probability joins the tail, which stays
the "everything else" category of the loss. Summing the probabilities of the teacher ids that map
to one student id gives at most k distinct ids per row; the row's remaining slots are filled with
student ids that no teacher id maps to (``fillers``), at log-probability ``EMPTY_LOGPROB``, so the
kernel reads k distinct ids as before: under the mapped distribution those ids have probability
exactly 0 even with the whole teacher vocabulary, so saying so adds nothing false.

When the two tokenizers are the same the map is the identity and the targets are the cache's own.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distill.files import atomic_write_bytes
from teacher_cache.token_bytes import TokenPieces

# Log-probability of a filler slot: exp() of it is 0 in fp32 and bf16, and it stays finite, so
# P (log P - log Q) is 0 without a special case in the kernel.
EMPTY_LOGPROB = -1.0e4
MAP_VERSION = 1


def longest_prefix_map(teacher: TokenPieces, student: TokenPieces, specials: dict[int, int]) -> np.ndarray:
    """int64 [V_teacher]: the student id each teacher id maps to, -1 for none (module doc)."""
    by_bytes: dict[bytes, int] = {}
    for i, piece in enumerate(student.pieces):
        if piece and not student.special[i] and piece not in by_bytes:
            by_bytes[piece] = i
    longest = max((len(p) for p in by_bytes), default=0)
    out = np.full(len(teacher), -1, np.int64)
    for i, piece in enumerate(teacher.pieces):
        if teacher.special[i]:
            out[i] = specials.get(i, -1)
            continue
        for length in range(min(len(piece), longest), 0, -1):
            hit = by_bytes.get(piece[:length])
            if hit is not None:
                out[i] = hit
                break
    return out


@dataclass(frozen=True)
class VocabMap:
    teacher_to_student: np.ndarray  # int64 [V_teacher], -1: maps nowhere
    student_vocab: int

    @property
    def fillers(self) -> np.ndarray:
        """Student ids that no teacher id maps to, rarest-looking (highest) first."""
        hit = np.zeros(self.student_vocab, bool)
        mapped = self.teacher_to_student[self.teacher_to_student >= 0]
        hit[mapped] = True
        return np.flatnonzero(~hit)[::-1].copy()

    def is_identity(self) -> bool:
        if not hasattr(self, "_identity"):  # asked for every batch: computed once
            object.__setattr__(self, "_identity", bool(np.array_equal(self.teacher_to_student,
                                                                      np.arange(len(self.teacher_to_student)))))
        return self._identity


def pair_key(teacher_hash: str, student_hash: str) -> str:
    return hashlib.sha256(f"{MAP_VERSION}:{teacher_hash}:{student_hash}".encode()).hexdigest()[:16]


def cached_vocab_map(teacher: TokenPieces, student: TokenPieces, specials: dict[int, int], *, key: str,
                     folder: str | os.PathLike | None) -> VocabMap:
    """The pair's map from `folder`/<key>.npy, computed and written there (atomically) the first time;
    folder None: computed, never stored."""
    path = None if folder is None else Path(folder) / f"{key}.npy"
    if path is not None and path.is_file():
        table = np.load(path)
        if table.shape == (len(teacher),):
            return VocabMap(table.astype(np.int64), len(student))
    table = longest_prefix_map(teacher, student, specials)
    if path is not None:
        import io

        buffer = io.BytesIO()
        np.save(buffer, table)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buffer.getvalue())
    return VocabMap(table, len(student))


def map_rows(vmap: VocabMap, topk_ids: np.ndarray, topk_logprobs: np.ndarray, tail_logmass: np.ndarray,
             fillers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cached rows ([R, k] ids and log-probs, [R] log tail mass) over the student's vocabulary:
    (ids [R, k] int64, log-probs [R, k] float32, log tail mass [R] float32). Each row's distinct
    student ids come in the order of their first teacher slot (the cache's descending order, so an
    identity map returns the rows as they are), then filler slots (module doc)."""
    rows, k = topk_ids.shape
    if rows == 0 or vmap.is_identity():
        return topk_ids.astype(np.int64), topk_logprobs.astype(np.float32), tail_logmass.astype(np.float32)
    mapped = vmap.teacher_to_student[topk_ids]
    lp = topk_logprobs.astype(np.float64)
    nowhere = mapped < 0
    extra = np.where(nowhere, np.exp(lp), 0.0).sum(1)  # mass that maps nowhere joins the tail
    with np.errstate(divide="ignore"):
        tail = np.where(extra > 0, np.logaddexp(tail_logmass.astype(np.float64), np.log(extra)), tail_logmass)
    # segments: each row's slots grouped by student id (sorted within the row), flattened
    order = np.argsort(mapped, 1, kind="stable")
    key = np.take_along_axis(mapped, order, 1).ravel()
    row_of = np.repeat(np.arange(rows), k)
    first_of_segment = np.ones(rows * k, bool)
    first_of_segment[1:] = (key[1:] != key[:-1]) | (row_of[1:] != row_of[:-1])
    starts = np.flatnonzero(first_of_segment)
    seg_lp = np.logaddexp.reduceat(np.take_along_axis(lp, order, 1).ravel(), starts)
    seg_first = np.minimum.reduceat(order.ravel(), starts)  # the segment's first slot in the cache's order
    seg_id, seg_row = key[starts], row_of[starts]
    keep = seg_id >= 0  # the "maps nowhere" segment is not a slot
    seg_lp, seg_first, seg_id, seg_row = seg_lp[keep], seg_first[keep], seg_id[keep], seg_row[keep]
    # each row's segments in the order of their first slot, placed from column 0
    place = np.argsort(seg_row * k + seg_first, kind="stable")
    seg_lp, seg_id, seg_row = seg_lp[place], seg_id[place], seg_row[place]
    per_row = np.bincount(seg_row, minlength=rows)
    column = np.arange(len(seg_row)) - (np.cumsum(per_row) - per_row)[seg_row]
    out_ids = np.full((rows, k), -1, np.int64)
    out_lp = np.full((rows, k), EMPTY_LOGPROB, np.float64)
    out_ids[seg_row, column], out_lp[seg_row, column] = seg_id, seg_lp
    need = k - int(per_row.min())
    if need > len(fillers):
        raise ValueError(f"{need} filler ids needed, the student vocabulary has only {len(fillers)} that no "
                         "teacher id maps to")
    if need:
        empty = out_ids < 0
        slot = np.clip(np.cumsum(empty, 1) - 1, 0, len(fillers) - 1)
        out_ids = np.where(empty, fillers[slot], out_ids)
    return out_ids, out_lp.astype(np.float32), tail.astype(np.float32)
