"""One cached sequence in the student's tokens, aligned with the teacher's on byte offsets.

The teacher's ids of a cached sequence are turned back into their exact bytes
(teacher_cache/token_bytes.py). Each run of text between special tokens is tokenized by the
student's tokenizer; each special token maps to the student's special token of the same content,
else of the same role (EOS, BOS, PAD, UNK), else it is dropped (counted). Positions live on one
axis: text bytes count one each, a special token one unit of its own, so a boundary is a number.

Student position j is *aligned* with teacher row i when student token j and teacher token i end
at the same boundary: both have read the same bytes, and the teacher's row i (its distribution
over the next token) is a distribution over what the student predicts next. The rest of the
student's positions end inside a teacher token.

Bytes that are not valid UTF-8 (a window that starts or ends inside a multi-byte character) cannot
be tokenized as text: each becomes the student's single-byte token where it has one (byte-level
BPE and byte fallback do), else it is skipped (counted as ``unencodable_bytes``). Where the student
tokenizer's own tokens do not spell its input back (a normalizer, an unknown-token), the tokenizer's
character offsets place its tokens instead (counted as ``offset_runs``). Nothing here raises on text.

When the two tokenizers are the same (``same``), the student's tokens are the cached ids as they
are, every position aligned: re-tokenizing a window's text need not reproduce them (a window
starts at a token boundary, not where the tokenizer would start).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from teacher_cache.token_bytes import TokenPieces

ROLES = ("eos", "bos", "pad", "unk")


def special_roles(tokenizer) -> dict[str, int]:
    """{"eos": id, ...} for the roles a tokenizer fills."""
    roles = {}
    for role in ROLES:
        value = getattr(tokenizer, f"{role}_token_id", None)
        if value is not None:
            roles[role] = int(value)
    return roles


def special_map(teacher: TokenPieces, teacher_roles: dict, student: TokenPieces, student_roles: dict) -> dict[int, int]:
    """Teacher special id -> the student's special id of the same content, else of the same role."""
    out = {}
    role_of = {i: role for role, i in teacher_roles.items()}
    for content, i in teacher.special_by_content.items():
        if content in student.special_by_content:
            out[i] = student.special_by_content[content]
        elif role_of.get(i) in student_roles:
            out[i] = student_roles[role_of[i]]
    for role, i in teacher_roles.items():  # a role id that is not an added special token
        if i not in out and teacher.special[i] and role in student_roles:
            out[i] = student_roles[role]
    return out


@dataclass
class Alignment:
    """A teacher sequence of n rows in the student's tokens (module doc)."""

    student_ids: np.ndarray  # int64 [m]
    teacher_row: np.ndarray  # int64 [m]: the teacher row aligned with student position j, -1 where none
    student_ends: np.ndarray  # int64 [m]: where each student token ends on the common axis
    teacher_ends: np.ndarray  # int64 [n]: where each teacher token ends
    counts: Counter = field(default_factory=Counter)  # unencodable_bytes, dropped_specials, offset_runs


def _utf8_pieces(data: bytes):
    """(kind, start, stop) over `data`: "text" for maximal valid UTF-8 runs, "bytes" for the rest."""
    pos, n = 0, len(data)
    while pos < n:
        try:
            data[pos:].decode("utf-8")
            yield "text", pos, n
            return
        except UnicodeDecodeError as e:
            if e.start:
                yield "text", pos, pos + e.start
            yield "bytes", pos + e.start, pos + e.end
            pos += e.end


class Aligner:
    """Aligns cached teacher sequences with a student tokenizer (module doc)."""

    def __init__(self, teacher: TokenPieces, teacher_roles: dict, student: TokenPieces, student_tokenizer, *,
                 same: bool = False):
        self.teacher, self.student, self.same = teacher, student, same
        self.backend = student_tokenizer.backend_tokenizer
        self.specials = special_map(teacher, teacher_roles, student, special_roles(student_tokenizer))
        self.teacher_units = np.where(teacher.special, 1, teacher.lengths)  # a special token is one unit
        self.student_lengths = student.lengths
        byte_ids = np.full(256, -1, np.int64)
        for i, piece in enumerate(student.pieces):
            if len(piece) == 1 and not student.special[i] and byte_ids[piece[0]] < 0:
                byte_ids[piece[0]] = i
        self.byte_ids = byte_ids

    def align(self, teacher_ids) -> Alignment:
        return self.align_many([teacher_ids])[0]

    def align_many(self, sequences) -> list[Alignment]:
        """Each teacher id sequence aligned; the student tokenizer sees all their text in one batch call."""
        if self.same:  # the student's tokenizer is the teacher's: its tokens are the cached ones
            out = []
            for seq in sequences:
                ids = np.asarray(seq, np.int64)
                ends = np.cumsum(self.teacher_units[ids])
                out.append(Alignment(ids, np.arange(len(ids)), ends, ends))
            return out
        plans, texts = [], []
        for seq in sequences:
            ids = np.asarray(seq, np.int64)
            counts: Counter = Counter()
            plans.append((ids, self._plan(ids, texts, counts), counts))
        encodings = self.backend.encode_batch([text for text, _ in texts], add_special_tokens=False) if texts else []
        return [self._assemble(ids, parts, counts, texts, encodings) for ids, parts, counts in plans]

    def _plan(self, ids: np.ndarray, texts: list, counts: Counter) -> list:
        """A sequence's parts on the common axis, in order: (student ids, their ends) where known, or
        (index into `texts`, the axis position where that text starts) for text to tokenize, appended
        to `texts` as (str, its UTF-8 bytes)."""
        ends = np.cumsum(self.teacher_units[ids])
        special = self.teacher.special[ids]
        parts, i, n = [], 0, len(ids)
        while i < n:
            start = int(ends[i] - self.teacher_units[ids[i]])
            if special[i]:
                mapped = self.specials.get(int(ids[i]))
                if mapped is None:
                    counts["dropped_specials"] += 1
                else:
                    parts.append((np.array([mapped]), np.array([ends[i]])))
                i += 1
                continue
            j = i
            while j < n and not special[j]:
                j += 1
            data = self.teacher.decode(ids[i:j])
            for kind, lo, hi in _utf8_pieces(data):
                if kind == "text":
                    texts.append((data[lo:hi].decode("utf-8"), data[lo:hi]))
                    parts.append((len(texts) - 1, start + lo))
                    continue
                for b in range(lo, hi):
                    if self.byte_ids[data[b]] < 0:
                        counts["unencodable_bytes"] += 1
                    else:
                        parts.append((np.array([self.byte_ids[data[b]]]), np.array([start + b + 1])))
            i = j
        return parts

    def _assemble(self, ids, parts, counts: Counter, texts: list, encodings) -> Alignment:
        ends = np.cumsum(self.teacher_units[ids])
        student_ids, student_ends = [], []
        for part in parts:
            if isinstance(part[0], np.ndarray):
                student_ids.append(part[0])
                student_ends.append(part[1])
                continue
            index, start = part
            run_ids, run_ends = self._placed(*texts[index], encodings[index], counts)
            student_ids.append(run_ids)
            student_ends.append(run_ends + start)
        n = len(ids)
        s_ids = np.concatenate(student_ids) if student_ids else np.zeros(0, np.int64)
        s_ends = np.concatenate(student_ends) if student_ends else np.zeros(0, np.int64)
        where = np.searchsorted(ends, s_ends)
        hit = (where < n) & (ends[np.minimum(where, n - 1)] == s_ends) if n else np.zeros(len(s_ends), bool)
        return Alignment(s_ids.astype(np.int64), np.where(hit, where, -1).astype(np.int64), s_ends.astype(np.int64),
                         ends, counts)

    def _placed(self, text: str, data: bytes, encoding, counts: Counter) -> tuple[np.ndarray, np.ndarray]:
        """The student's ids for the text `data` and where each ends (bytes from its start)."""
        ids = np.asarray(encoding.ids, np.int64)
        if not len(ids):
            return ids, ids
        lengths = self.student_lengths[ids]
        if int(lengths.sum()) == len(data) and self.student.decode(ids) == data:
            return ids, np.cumsum(lengths)
        counts["offset_runs"] += 1  # the tokens do not spell the text: place them by their character offsets
        char_end = np.cumsum([0] + [len(c.encode("utf-8")) for c in text])
        return ids, char_end[np.asarray([end for _, end in encoding.offsets], np.int64)]
