"""A pruned student for another tokenizer: new embedding and lm-head rows, initialised by tokenizer
transplantation (issue 42, cross-tokenizer distillation).

Each student token is spelled with teacher tokens, and its row is the mean of theirs:
  an ordinary token: its exact bytes (teacher_cache/token_bytes.py) re-tokenized by the teacher when
      they are UTF-8 text, else (a partial multi-byte character) byte by byte through the teacher's
      single-byte tokens (bytes the teacher never saw, such as 0xC0 or 0xFF, have none and are left
      out, as the teacher's own tokenizer drops them from text);
  a special token: the teacher's special token of the same content ("<|endoftext|>"), else the
      teacher's token of the same role (BOS, EOS, PAD, UNK);
  anything else: no spelling, the mean of all the teacher's rows.
The lm-head rows are built the same way from the teacher's lm-head; tied embeddings stay tied.

  spellings                the teacher ids that spell each student id (pure, no torch)
  transplanted_rows        the mean rows of those spellings (torch)
  fit_vocabulary           initial_student's hook: gives a pruned student its tokenizer's rows
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from distill.configs import ConfigError
from student.model import INIT_STD, Student
from teacher_cache.identity import tokenizer_info
from student.cross_tokenizer.align import ROLES, special_map, special_roles
from teacher_cache.token_bytes import token_pieces

__all__ = ["fit_vocabulary", "spellings", "transplanted_rows"]

logger = logging.getLogger(__name__)


def spellings(student_tokenizer, teacher_tokenizer) -> list[tuple[int, ...]]:
    """For each id of the student tokenizer, the teacher ids whose rows its row is the mean of
    (module doc); () where no spelling exists (its row is then the mean of all teacher rows)."""
    student = token_pieces(student_tokenizer, "tokenizer")
    teacher = token_pieces(teacher_tokenizer, "teacher")
    byte_ids = {}  # byte -> the teacher's first id of that one byte
    for i, piece in enumerate(teacher.pieces):
        if len(piece) == 1:
            byte_ids.setdefault(piece[0], i)
    spelled: list[tuple[int, ...]] = [()] * len(student)
    text_ids, texts = [], []
    for i, piece in enumerate(student.pieces):
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:  # part of a multi-byte character: no text to re-tokenize
            spelled[i] = tuple(byte_ids[b] for b in piece if b in byte_ids)
            continue
        if text:
            text_ids.append(i)
            texts.append(text)
    encoded = teacher_tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for i, ids in zip(text_ids, encoded):
        spelled[i] = tuple(ids)
    # special tokens: by identical content, else by role (the student's side of align.special_map)
    for i, teacher_id in special_map(student, special_roles(student_tokenizer), teacher,
                                     special_roles(teacher_tokenizer)).items():
        spelled[i] = (teacher_id,)
    return spelled


def transplanted_rows(teacher_rows: torch.Tensor, spelled: list[tuple[int, ...]], num_teacher_tokens: int) -> torch.Tensor:
    """teacher_rows [V_teacher, D] -> [len(spelled), D] of its dtype and device: row i the mean of
    teacher_rows[spelled[i]] (in fp32), or where spelled[i] is empty the mean of the first
    `num_teacher_tokens` rows (the teacher tokenizer's ids; rows past them are padding)."""
    device = teacher_rows.device
    flat = torch.tensor([t for ids in spelled for t in ids], dtype=torch.long, device=device)
    lengths = torch.tensor([len(ids) for ids in spelled], dtype=torch.long, device=device)
    offsets = torch.cumsum(lengths, 0) - lengths
    rows_fp32 = teacher_rows.float()
    rows = F.embedding_bag(flat, rows_fp32, offsets, mode="mean")  # an empty bag gives zeros
    rows[lengths == 0] = rows_fp32[:num_teacher_tokens].mean(0)
    return rows.to(teacher_rows.dtype)


def fit_vocabulary(model: Student, teacher_dir, tokenizer_dir, embedding_init: str) -> str:
    """Give `model`, pruned from the teacher in `teacher_dir`, the embedding and lm-head of the
    tokenizer in `tokenizer_dir` (None: the teacher's), in place: transplanted (module doc) or drawn
    anew (embedding_init "random": normal with the model's own init std). With the teacher's own
    tokenizer, "transplant" keeps the teacher's rows. Returns what it did for the run's identity
    ("" when nothing: the student is the pruned teacher)."""
    assert embedding_init in ("transplant", "random"), embedding_init  # TrainConfig checks the user's value
    same_folder = tokenizer_dir is None or Path(tokenizer_dir).resolve() == Path(teacher_dir).resolve()
    student_tokenizer = None if same_folder else _load_tokenizer(tokenizer_dir, "tokenizer")
    teacher_tokenizer = None if same_folder else _load_tokenizer(teacher_dir, "teacher")
    if same_folder or tokenizer_info(student_tokenizer)["hash"] == tokenizer_info(teacher_tokenizer)["hash"]:
        if embedding_init == "transplant":
            return ""
        _set_rows(model, *_random_rows(model, model.config.vocab_size))
        return ":embedding_init=random"
    vocab_size = len(student_tokenizer)
    if embedding_init == "random":
        embed, head = _random_rows(model, vocab_size)
    else:
        spelled = spellings(student_tokenizer, teacher_tokenizer)
        _check_ids(spelled, model.config.vocab_size, teacher_dir)
        num_teacher_tokens = min(len(teacher_tokenizer), model.config.vocab_size)
        embed = transplanted_rows(model.embed_tokens.weight.detach(), spelled, num_teacher_tokens)
        head = None if model.lm_head is None else transplanted_rows(model.lm_head.weight.detach(), spelled,
                                                                    num_teacher_tokens)
        logger.info("transplanted %d embedding rows from the teacher's %d (%d without a spelling: the teacher's mean)",
                    vocab_size, model.config.vocab_size, sum(not ids for ids in spelled))
    _set_rows(model, embed, head)
    special = {f"{role}_token_id": getattr(student_tokenizer, f"{role}_token_id", None) for role in ROLES}
    extra = {k: v for k, v in model.config.extra.items() if k not in special}
    extra.update({k: v for k, v in special.items() if v is not None})
    model.config = model.config.replace(vocab_size=vocab_size, extra=extra)
    return f":tokenizer={tokenizer_info(student_tokenizer)['hash']}:embedding_init={embedding_init}"


def _load_tokenizer(folder, option: str):
    from transformers import AutoTokenizer  # seconds to import; only a new vocabulary needs it

    if not Path(folder).is_dir():
        raise ConfigError(option, f"is {str(folder)!r}, which is not a folder; give a folder with the tokenizer's "
                                  "files (tokenizer.json, tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(option, f"is {str(folder)!r}, which holds no tokenizer transformers can load "
                                  f"({type(e).__name__}); give a folder with tokenizer.json / tokenizer_config.json") from None


def _check_ids(spelled: list[tuple[int, ...]], teacher_rows: int, teacher_dir) -> None:
    largest = max((t for ids in spelled for t in ids), default=-1)
    if largest >= teacher_rows:
        raise ConfigError("teacher", f"is {str(teacher_dir)!r}, whose tokenizer has id {largest} but whose model has "
                                     f"only {teacher_rows} embedding rows; use a teacher whose tokenizer fits its model")


def _random_rows(model: Student, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(embedding, lm-head or None when tied) [vocab_size, D], normal with std INIT_STD as Student's own init."""
    like = model.embed_tokens.weight
    draw = lambda: torch.empty(vocab_size, like.shape[1], dtype=like.dtype, device=like.device).normal_(std=INIT_STD)
    return draw(), None if model.lm_head is None else draw()


def _set_rows(model: Student, embed: torch.Tensor, head: torch.Tensor | None) -> None:
    """New embedding (and, untied, lm-head) modules holding these rows; a tied lm-head is the embedding."""
    vocab_size, hidden_size = embed.shape
    model.embed_tokens = nn.Embedding(vocab_size, hidden_size, device="meta")
    model.embed_tokens.weight = nn.Parameter(embed)
    if head is not None:
        model.lm_head = nn.Linear(hidden_size, vocab_size, bias=False, device="meta")
        model.lm_head.weight = nn.Parameter(head)
