"""Held-out evaluation of a student against the cached teacher, and of the teacher itself.

Everything is measured on cache rows: KL to the teacher over the k + 1 categories "top-k + tail"
(the training loss's own KL, student/loss.py, in its "bucket" form at the cache's temperature; on
a sampled cache the loss's unbiased estimate of the full KL instead), cross-entropy / perplexity on
the actual next tokens, and top-1 agreement with the teacher; for a ReLU-gated (sparse FFN)
student also the per-layer sparsity and dead neurons on the same sequences.

Given the UTF-8 bytes of every token id (`token_bytes_of`), also bits per byte: the cross-entropy
of the actual next tokens in bits, divided by the bytes of those same tokens (BITS_PER_BYTE_NOTE).
Unlike the per-token numbers it does not depend on how the text was cut into tokens, so students of
different tokenizers, and caches of one corpus, compare on it.

With a teacher model (`distill eval --teacher`, opened by pipelines/teacher_eval.py) the teacher
runs on the same rows, so every kind of cache is measured on one ground truth: the exact
full-vocabulary KL(teacher || student) and the expected calibration error of the student's top-1.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from distill.devices import resolve_device, resolve_dtype
from distill.errors import DistillUserError
from student.checkpoint_dirs import latest_checkpoint
from student.cross_tokenizer.batches import batches_for, open_cross_tokenizer
from student.data import Batch, CacheBatches, load_tokenizer, split_indices
from student.long_context.config import LongContextConfig
from student.long_context.engine import chunked_forward
from student.loss import LossConfig, distill_loss
from student.model import Student
from teacher_cache.reader import CacheReader
from teacher_cache.token_bytes import token_pieces

logger = logging.getLogger(__name__)

# Bytes of one [rows, V] fp32 logits block: the row chunk of the vocabulary-wide metrics (CE, top-1,
# and with a teacher the full-vocabulary KL and calibration) is sized so one block fits; a handful
# of such blocks live at once (student and teacher logits and their log-softmaxes).
LOGITS_BLOCK_BYTES = 200 << 20
CALIBRATION_BINS = 15  # equal-width confidence bins of the expected calibration error, as the contract fixes
# Merging the vocabulary outside the teacher's top-k into one category can only lose information.
KL_NOTE = ("kl is a lower bound of the full-vocabulary KL(teacher || student): it is measured over the teacher's "
           "top-k ids plus one tail category, at the cache's temperature")
SAMPLED_KL_NOTE = ("kl is the cache's estimate of the full-vocabulary KL(teacher || student) from its sampled ids "
                   "(RS-KD's importance weights, at the cache's temperature): unbiased but noisy, neither a lower nor "
                   "an upper bound; top1 compares with the most-sampled id, not always the teacher's top-1")
HYBRID_KL_NOTE = ("kl is the cache's estimate of the full-vocabulary KL(teacher || student): exact over the teacher's "
                  "top-k ids, RS-KD's importance-weighted estimate over the ids drawn outside them (at the cache's "
                  "temperature): unbiased, neither a lower nor an upper bound")
FULL_VOCAB_NOTE = ("full_vocab_kl is the exact KL(teacher || student) over the whole vocabulary at the cache's "
                   "temperature, the teacher run on the held-out rows; calibration_error is the expected calibration "
                   f"error of the top-1 at temperature 1 against the actual next token ({CALIBRATION_BINS} "
                   "equal-width confidence bins)")
BITS_PER_BYTE_NOTE = ("bits_per_byte is the cross-entropy of the actual next tokens in bits, over the UTF-8 bytes of "
                      "those tokens: comparable across tokenizers and across caches of one corpus (special tokens "
                      "such as EOS count their bits and no bytes)")
CROSS_KL_NOTE = ("kl (and top1) is measured where the student's context ends where a teacher token ends, over the "
                 "teacher's top-k mapped onto the student's vocabulary plus one tail category, at the cache's "
                 "temperature (a lower bound of the KL to that mapped teacher); ce and bits per byte over every "
                 "student token")
# The evaluation's KL: the training loss with the tail as one category, at the cache's temperature.
_EVAL_LOSS = LossConfig(tail="bucket", temperature=None, ce_weight=0.0)


@dataclass
class EvalResult:
    kl: float  # mean over rows of KL(teacher || student) over top-k + tail bucket, nats: a lower bound (KL_NOTE)
    ce: float  # mean cross-entropy of the actual next token, nats (rows that have one)
    ppl: float  # exp(ce)
    top1: float  # fraction of rows where the student's argmax is the teacher's top-1 id
    tokens: int  # rows evaluated (positions with a teacher distribution)
    # Sparse FFN students only (None otherwise), per layer, over every position of the evaluated batches:
    ffn_nnz: list[float] | None = None  # mean non-zeros of h = relu(x Wg) * (x Wu) per token
    ffn_sparsity: list[float] | None = None  # 1 - ffn_nnz / d_ff
    ffn_dead: list[float] | None = None  # share of the d_ff neurons that are zero on every evaluated token
    # With a teacher model only (None otherwise; FULL_VOCAB_NOTE):
    full_vocab_kl: float | None = None  # mean over rows of the exact KL(teacher || student) over the vocabulary, nats
    calibration_error: float | None = None  # ECE of the top-1 at temperature 1 (rows that have a next token)
    # With the bytes of the token ids only (None otherwise, and in rows written before it; BITS_PER_BYTE_NOTE):
    bits_per_byte: float | None = None  # CE of the actual next tokens summed, / ln 2, / their UTF-8 bytes

    def to_dict(self) -> dict:
        """The fields, less the optional ones that are None (so metrics rows stay as they were)."""
        optional = lambda k: k.startswith("ffn_") or k in ("full_vocab_kl", "calibration_error", "bits_per_byte")
        return {k: v for k, v in asdict(self).items() if v is not None or not optional(k)}

    @classmethod
    def from_dict(cls, d: dict) -> EvalResult:
        """From to_dict() output or a metrics row (other keys ignored; a missing optional one is None)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def mixed(cls, results: list[EvalResult], weights) -> EvalResult:
        """Several caches' evaluations as one: each figure the mean weighted by `weights` (summing to
        1; per layer for the sparse FFN's lists), ppl exp of that ce, tokens summed; an optional
        figure only when every result has it."""
        def mean(values):
            if any(v is None for v in values):
                return None
            if isinstance(values[0], list):
                return [sum(w * x for w, x in zip(weights, column)) for column in zip(*values)]
            return sum(w * v for w, v in zip(weights, values))

        figures = {f.name: mean([getattr(r, f.name) for r in results]) for f in fields(cls)
                   if f.name not in ("ppl", "tokens")}
        return cls(**figures, ppl=math.exp(figures["ce"]), tokens=sum(r.tokens for r in results))

    def summary(self) -> str:
        """One console line of the numbers."""
        full = "" if self.full_vocab_kl is None else (f", full-vocabulary KL {self.full_vocab_kl:.4f}, "
                                                      f"ECE {self.calibration_error:.4f}")
        bpb = "" if self.bits_per_byte is None else f", {self.bits_per_byte:.4f} bits/byte"
        return (f"KL to teacher (top-k bound) {self.kl:.4f}, CE {self.ce:.3f}, PPL {self.ppl:.2f}, "
                f"top-1 {self.top1:.3f}{bpb}{full} ({self.tokens:,} tokens)")


def target_kind(reader: CacheReader) -> str:
    """"topk", "sampled" or "topk+sampled": the kind of the cache's targets (a manifest without one is top-k)."""
    return getattr(reader.manifest.spec.targets, "kind", "topk")  # the field comes with sampled caches


def kl_note(reader: CacheReader, cross_tokenizer: bool = False) -> str:
    """What the cache-based `kl` of an evaluation on `reader` measures (cross_tokenizer: of a student
    of another tokenizer, student/cross_tokenizer)."""
    if cross_tokenizer:
        return CROSS_KL_NOTE
    return {"sampled": SAMPLED_KL_NOTE, "topk+sampled": HYBRID_KL_NOTE}.get(target_kind(reader), KL_NOTE)


def token_bytes_of(folder, tokenizer=None) -> np.ndarray | None:
    """int64 [V]: the UTF-8 bytes each id of the tokenizer in HF folder `folder` (or `tokenizer`,
    already loaded from it) stands for (0 for special ids such as EOS; teacher_cache/token_bytes.py).
    None, with a warning, for a tokenizer that cannot say (neither byte-level BPE nor byte fallback):
    its evaluations then have no bits per byte."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(folder)
    try:
        return token_pieces(tokenizer).lengths
    except DistillUserError as e:
        logger.warning("no bits per byte for the tokenizer of %s: %s", folder, str(e).removeprefix("--tokenizer: "))
        return None


def byte_table(token_bytes: torch.Tensor | np.ndarray | None) -> torch.Tensor | None:
    """`token_bytes` (integers [V] >= 0, the bytes of each id) as an int64 host tensor; None stays None."""
    if token_bytes is None:
        return None
    table_V = torch.as_tensor(token_bytes).cpu()
    if table_V.ndim != 1 or table_V.is_floating_point() or table_V.is_complex() or bool((table_V < 0).any()):
        raise ValueError(f"token_bytes must be a 1-D array of non-negative integers (the bytes of each id), got "
                         f"{table_V.dtype} of shape {tuple(table_V.shape)}")
    return table_V.long()


def predicted_bytes(batch: Batch, table_V: torch.Tensor) -> int:
    """The UTF-8 bytes of the tokens `batch` predicts: table_V (int64 [V], byte_table) at target_ids
    on the rows that have a next token (target_ids >= 0 and not padding), the rows cross-entropy sums."""
    target_R = batch.target_ids[batch.mask & (batch.target_ids >= 0)].cpu()
    if target_R.numel() and int(target_R.max()) >= len(table_V):
        raise ValueError(f"token_bytes has {len(table_V)} entries but a target id is {int(target_R.max())}: pass "
                         "the byte lengths of the vocabulary the batch's target_ids are in")
    return int(table_V[target_R].sum())


def bits_per_byte(ce_nats: float, num_bytes: int | None) -> float | None:
    """Cross-entropy summed over predicted tokens (nats) in bits per byte of those tokens; None
    without the bytes, or when they are 0 (only special tokens were predicted)."""
    return ce_nats / math.log(2) / num_bytes if num_bytes else None


def rows_per_block(vocab_size: int, block_bytes: int = LOGITS_BLOCK_BYTES) -> int:
    """Rows of [rows, vocab_size] fp32 logits in `block_bytes` (at least one)."""
    return max(1, block_bytes // (4 * vocab_size))


class Calibration:
    """Sums of the expected calibration error (ECE) of a top-1 prediction, bin by bin.

    A row of confidence c (the top-1 probability) falls in bin ceil(c * num_bins) - 1 of
    `num_bins` equal-width bins, so bin b holds (b / num_bins, (b + 1) / num_bins] (c = 0 in bin 0).
    ECE = sum over bins of (rows in the bin / all rows) * |accuracy in the bin - mean confidence in
    the bin| = sum over bins |hits - sum of confidences| / all rows; an empty bin adds nothing.
    Sums are float64 on the host, so chunks and batches add up exactly as one pass would.
    """

    def __init__(self, num_bins: int = CALIBRATION_BINS):
        self.num_bins = num_bins
        self.rows = torch.zeros(num_bins, dtype=torch.float64)
        self.confidence = torch.zeros(num_bins, dtype=torch.float64)
        self.hits = torch.zeros(num_bins, dtype=torch.float64)

    def add(self, confidence_R: torch.Tensor, correct_R: torch.Tensor) -> None:
        """confidence_R: float [R] in [0, 1]; correct_R: bool [R], whether the top-1 was right."""
        conf = confidence_R.detach().double().cpu()
        bins = (conf * self.num_bins).ceil().long().sub(1).clamp(0, self.num_bins - 1)
        self.rows += torch.bincount(bins, minlength=self.num_bins).double()
        self.confidence += torch.bincount(bins, weights=conf, minlength=self.num_bins)
        self.hits += torch.bincount(bins, weights=correct_R.detach().double().cpu(), minlength=self.num_bins)

    def add_logits(self, logits_CV: torch.Tensor, target_C: torch.Tensor, has_C: torch.Tensor) -> None:
        """The top-1 of fp32 logits [C, V] at temperature 1 against target ids [C], on rows has_C (bool [C])."""
        top_C, pred_C = logits_CV.max(-1)
        confidence_C = torch.exp(top_C - torch.logsumexp(logits_CV, -1))
        self.add(confidence_C[has_C], (pred_C == target_C)[has_C])

    def error(self) -> float:
        return float((self.hits - self.confidence).abs().sum() / self.rows.sum().clamp_min(1))


def full_vocab_kl_sum(student_CV: torch.Tensor, teacher_CV: torch.Tensor, mask_C: torch.Tensor,
                      temperature: float) -> float:
    """Sum over rows mask_C (bool [C]) of KL(softmax(teacher / T) || softmax(student / T)) over the
    whole vocabulary; logits fp32 [C, V] each (one vocabulary: the caller cuts both to the same V)."""
    logp_CV = torch.log_softmax(teacher_CV / temperature, -1)
    logq_CV = torch.log_softmax(student_CV / temperature, -1)
    kl_C = torch.nn.functional.kl_div(logq_CV, logp_CV, reduction="none", log_target=True).sum(-1)
    return kl_C[mask_C].double().sum().item()


class _Sums:
    def __init__(self, with_teacher: bool = False, with_bytes: bool = False):
        self.kl = self.ce = self.top1 = self.full_kl = 0.0
        self.rows = self.ce_rows = 0
        self.kl_rows = 0  # the rows with teacher targets (Batch.kd_rows): all but a cross-tokenizer batch's unaligned ones
        self.bytes = 0 if with_bytes else None  # UTF-8 bytes of the tokens CE is summed over
        self.ffn = None  # sparse students: [nnz x rows summed [L], active [L, d_ff], rows]
        self.calibration = Calibration() if with_teacher else None

    def add_ffn(self, terms: list, num_rows: int) -> None:
        """terms: per layer FFNTerms (l1, FFNStats) of one forward over num_rows real tokens."""
        nnz_L = torch.stack([s.nnz for _, s in terms]).double() * num_rows
        active_LF = torch.stack([s.active for _, s in terms])
        if self.ffn is None:
            self.ffn = [nnz_L, active_LF, num_rows]
        else:
            self.ffn = [self.ffn[0] + nnz_L, self.ffn[1] | active_LF, self.ffn[2] + num_rows]

    def result(self, d_ff: int | None = None) -> EvalResult:
        ce = self.ce / max(self.ce_rows, 1)
        extra = {}
        if self.ffn is not None:
            nnz = (self.ffn[0] / self.ffn[2]).tolist()
            extra = {"ffn_nnz": nnz, "ffn_sparsity": [1 - n / d_ff for n in nnz],
                     "ffn_dead": (1 - self.ffn[1].float().mean(1)).tolist()}
        if self.calibration is not None:
            extra.update(full_vocab_kl=self.full_kl / max(self.rows, 1), calibration_error=self.calibration.error())
        return EvalResult(kl=self.kl / max(self.kl_rows, 1), ce=ce, ppl=math.exp(min(ce, 700.0)),
                          top1=self.top1 / max(self.kl_rows, 1), tokens=self.rows,
                          bits_per_byte=bits_per_byte(self.ce, self.bytes), **extra)


def _ce_and_top1(logits_CV, batch: Batch, rows: slice):
    """(sum CE, CE rows, sum top-1 hits) of one row chunk; logits fp32 [C, V]."""
    mask_C = batch.mask[rows]
    logq_CV = torch.log_softmax(logits_CV, dim=-1)
    target_C = batch.target_ids[rows]
    has_C = mask_C & (target_C >= 0)
    ce = -logq_CV.gather(1, target_C.clamp_min(0)[:, None])[:, 0][has_C].sum()
    hits = (logits_CV.argmax(-1) == batch.topk_ids[rows, 0])[batch.kd_rows[rows]].sum()
    return ce.item(), int(has_C.sum()), hits.item()


@torch.no_grad()
def evaluate_student(model, reader: CacheReader, indices, *, batch_size: int, device, seq_len: int | None = None,
                     autocast_dtype: torch.dtype | None = None, row_chunk: int | None = None,
                     long: LongContextConfig | None = None, progress: bool = False,
                     token_bytes: torch.Tensor | np.ndarray | None = None, batches=CacheBatches) -> EvalResult:
    """Evaluate `model` (a ``Student``) on sequences `indices` of `reader`, without gradients.

    kl: the training loss's KL (student/loss.py, the fused kernel, summed over rows): forward
    KL(teacher || student) at the cache's temperature over the k + 1 categories "the teacher's
    top-k ids plus one tail bucket" (the student's tail is its mass outside the top-k), a lower
    bound of the full-vocabulary KL (KL_NOTE); on a sampled cache the loss's estimate of the full
    KL (SAMPLED_KL_NOTE). ce / ppl: cross-entropy of the actual next token (rows that have one).
    top1: agreement of the student's argmax with the cache's first id (the teacher's top-1 on a
    top-k cache). For ce and top1 the logits are formed `row_chunk` rows at a time (default: one
    LOGITS_BLOCK_BYTES block); the [tokens, V] logits never exist at once. seq_len crops each
    sequence to its first seq_len rows. With `long.chunk_tokens` the sequences run chunk by chunk
    against a paged key/value store, as in training (same results, the memory of one chunk). A
    ReLU-gated student also gets ffn_nnz / ffn_sparsity / ffn_dead per layer, counted over the real
    tokens of the batches (padding of ragged sequences left out). progress: a bar over the sequences
    while it runs, gone once done.

    token_bytes: integers [V] (torch or numpy), the UTF-8 bytes of each id of the vocabulary the
    batches' target_ids are in (`token_bytes_of`); with it bits_per_byte is the CE summed over the
    rows that have a next token, / ln 2, / the bytes of those target ids. Special ids have 0 bytes
    but their prediction's bits still count (BITS_PER_BYTE_NOTE). None: bits_per_byte is None.

    batches: the batch stream class (CacheBatches, or a cross-tokenizer student's,
    student.cross_tokenizer.batches.batches_for): kl and top1 are then over the rows with teacher
    targets (the aligned positions), ce and bits_per_byte over the student's own tokens.
    """
    sums, _ = _evaluate(model, None, reader, indices, batch_size=batch_size, device=device, seq_len=seq_len,
                        autocast_dtype=autocast_dtype, row_chunk=row_chunk, long=long, progress=progress,
                        token_bytes=token_bytes, batches=batches)
    return sums.result(model.config.intermediate_size)


@torch.no_grad()
def evaluate_against_teacher(model, teacher, reader: CacheReader, indices, *, batch_size: int, device,
                             seq_len: int | None = None, autocast_dtype: torch.dtype | None = None,
                             row_chunk: int | None = None, long: LongContextConfig | None = None,
                             progress: bool = False, token_bytes: torch.Tensor | np.ndarray | None = None,
                             batches=CacheBatches) -> tuple[EvalResult, float]:
    """`evaluate_student` with the teacher `teacher` (a ``Student``-like model: the same decoder,
    loaded from the teacher's folder) run on the same rows, through the same chunks.

    Returns (the student's EvalResult with full_vocab_kl and calibration_error set, the teacher's
    own calibration_error on the same rows). full_vocab_kl: mean over the evaluated rows of the
    exact KL(p || q) over the vocabulary, p and q the teacher's and the student's softmax at the
    cache's temperature (over the first min(V_teacher, V_student) ids, renormalised, when their
    lm-heads differ in size). calibration_error: Calibration over the rows that have a next token,
    top-1 at temperature 1. Row chunks bound the [rows, V] fp32 blocks as in evaluate_student, and
    token_bytes gives bits_per_byte as there.
    """
    sums, teacher_calibration = _evaluate(model, teacher, reader, indices, batch_size=batch_size, device=device,
                                          seq_len=seq_len, autocast_dtype=autocast_dtype, row_chunk=row_chunk,
                                          long=long, progress=progress, token_bytes=token_bytes, batches=batches)
    return sums.result(model.config.intermediate_size), teacher_calibration.error()


def _evaluate(model, teacher, reader: CacheReader, indices, *, batch_size: int, device, seq_len: int | None,
              autocast_dtype: torch.dtype | None, row_chunk: int | None, long: LongContextConfig | None,
              progress: bool, token_bytes: torch.Tensor | np.ndarray | None = None,
              batches=CacheBatches) -> tuple[_Sums, Calibration | None]:
    """The loop of evaluate_student / evaluate_against_teacher: (the student's sums, the teacher's
    Calibration, None without a teacher)."""
    table_V = byte_table(token_bytes)
    models = [m for m in (model, teacher) if m is not None]
    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    sums = _Sums(with_teacher=teacher is not None, with_bytes=table_V is not None)
    teacher_calibration = Calibration() if teacher is not None else None
    data = batches(reader, indices, batch_size, seq_len=seq_len, shuffle=False)
    weight = model.lm_head_weight.float()
    teacher_weight = teacher.lm_head_weight.float() if teacher is not None else None
    vocab = weight.shape[0] if teacher is None else min(weight.shape[0], teacher_weight.shape[0])
    row_chunk = row_chunk or rows_per_block(max(weight.shape[0], vocab))
    cache_temperature = reader.manifest.spec.targets.temperature
    long = long or LongContextConfig()
    # Gone once done (leave=False): the result's line follows, and inside training the step bar stays alone.
    bar = tqdm(total=len(data.indices), disable=not progress, desc="eval", unit="seq", leave=False)
    for whole in data.epoch_batches():
        if table_V is not None:  # on the host, from the same rows and target ids as the CE below
            sums.bytes += predicted_bytes(whole, table_V)
        input_ids, mask = whole.input_ids.to(device), whole.mask.to(device)
        chunks = chunked_forward(model, input_ids, mask, long, autocast_dtype=autocast_dtype)
        teacher_chunks = (itertools.repeat(None) if teacher is None else
                          chunked_forward(teacher, input_ids, mask, long, autocast_dtype=autocast_dtype))
        for (start, end, hidden, terms), teacher_chunk in zip(chunks, teacher_chunks):
            batch = whole.positions(start, end).to(device)
            hidden_ND = hidden.reshape(-1, hidden.shape[-1]).float()
            if terms:  # a ReLU-gated student: statistics over the real tokens (the padding rows left out)
                sums.add_ffn(terms, batch.num_tokens)
            _, kl = distill_loss(hidden_ND, weight, batch, _EVAL_LOSS, cache_temperature=cache_temperature,
                                 reduction="sum", check_ids=not str(device).startswith("cuda"))
            sums.kl += kl.item()
            teacher_ND = None if teacher_chunk is None else teacher_chunk[2].reshape(hidden_ND.shape[0], -1).float()
            for lo in range(0, hidden_ND.shape[0], row_chunk):
                rows = slice(lo, lo + row_chunk)
                logits_CV = hidden_ND[rows] @ weight.T
                ce, ce_rows, hits = _ce_and_top1(logits_CV, batch, rows)
                sums.ce, sums.ce_rows, sums.top1 = sums.ce + ce, sums.ce_rows + ce_rows, sums.top1 + hits
                if teacher_ND is not None:
                    teacher_CV = teacher_ND[rows] @ teacher_weight.T
                    sums.full_kl += full_vocab_kl_sum(logits_CV[:, :vocab], teacher_CV[:, :vocab], batch.mask[rows],
                                                      cache_temperature)
                    target_C = batch.target_ids[rows]
                    has_C = batch.mask[rows] & (target_C >= 0)
                    sums.calibration.add_logits(logits_CV, target_C, has_C)
                    teacher_calibration.add_logits(teacher_CV, target_C, has_C)
            sums.rows += batch.num_tokens
            sums.kl_rows += int(batch.kd_rows.sum())
        bar.update(whole.input_ids.shape[0])
    bar.close()
    for m, training in zip(models, was_training):
        m.train(training)
    return sums, teacher_calibration


def teacher_reference(reader: CacheReader, indices, *, seq_len: int | None = None,
                      token_bytes: torch.Tensor | np.ndarray | None = None, batches=CacheBatches) -> EvalResult:
    """The teacher on the same rows, from the cache: ce from target_logprob, kl 0, top1 1.

    token_bytes: integers [V], the UTF-8 bytes of each id of the cache's (the teacher's) vocabulary;
    with it bits_per_byte is -(sum of target_logprob over the rows with a next token) / ln 2 / the
    bytes of the teacher's own next tokens there (special ids: their bits, 0 bytes). None: no
    bits_per_byte. Like ce it is at the cache's temperature (target_logprob's), the teacher's own at 1.
    batches: the batch stream class (an ensemble's: the teachers' mixture, student/mixture.py)."""
    table_V = byte_table(token_bytes)
    sums = _Sums(with_bytes=table_V is not None)
    for batch in batches(reader, indices, 64, seq_len=seq_len, shuffle=False).epoch_batches():
        has = batch.mask & (batch.target_ids >= 0)
        sums.ce -= batch.target_logprob[has].double().sum().item()
        if table_V is not None:
            sums.bytes += predicted_bytes(batch, table_V)
        sums.ce_rows += int(has.sum())
        sums.rows += batch.num_tokens
        sums.kl_rows += batch.num_tokens
        sums.top1 += batch.num_tokens
    return sums.result()


# Opens the teacher model for `distill eval --teacher` once the cache is known: (the cache's reader,
# the device) -> a Student-like model there (pipelines.teacher_eval.EvalTeacher checks and loads one).
TeacherOpener = Callable[[CacheReader, str], object]


def evaluate_run_or_folder(path, cache=None, heldout: int | None = None, *, batch_size: int | None = None,
                           device: str = "auto", seq_len: int | None = None, tokenizer=None,
                           chunk_tokens: int | None = None, teacher: TeacherOpener | None = None,
                           progress: bool = False) -> dict:
    """`distill eval`: evaluate a run directory (its run.json gives the cache, held-out split,
    evaluation sequences, seq_len and batch size; its final student, else its latest checkpoint; a
    run over several caches: the first, or `cache`, without its step-0 row, which covers them all) or
    a student HF folder with `cache` (held-out: the `heldout` evenly spaced sequences, default all of
    them; batch size 8 unless given).

    The cache must be of the student's tokenizer, as train-student requires: a run's (run.json
    records its hash), or for a folder the one in `tokenizer` (default: the folder itself).

    Returns {"teacher": EvalResult, "before": EvalResult | None, "after": EvalResult} for a run
    directory ("before": its step-0 student, recorded by the trainer, on the same sequences; None
    when `heldout` asks for other ones) and {"teacher", "student"} for a folder, plus "cache" (str)
    and "num_sequences" (int), and "kl_note" (kl_note: what the cache-based kl measures). chunk_tokens:
    run long sequences chunk by chunk (default: as the run trained, whole sequences for a folder).

    teacher: with it, the teacher model it opens runs on the held-out sequences beside the student
    (evaluate_against_teacher): the student's result gains full_vocab_kl and calibration_error, the
    teacher's row (its cache numbers) gains its own calibration_error and full_vocab_kl 0, and
    "full_vocab_note" (FULL_VOCAB_NOTE) is added. progress: a progress bar over the sequences.

    Bits per byte: every row gets bits_per_byte from the bytes of the student's tokenizer's ids
    (`token_bytes_of`: `tokenizer`, else the run's tokenizer folder, else its final student's; for a
    folder, its tokenizer), the cache's tokenizer too, and "bits_per_byte_note" (BITS_PER_BYTE_NOTE)
    is added; a tokenizer that cannot say its bytes (or a run whose tokenizer folder is gone) leaves
    them None, with a warning. A run's "before" row has one only if the trainer recorded it.
    """
    path = Path(path)
    device = resolve_device(device)
    initial = None
    is_run = (path / "run.json").exists()
    if is_run:
        run = json.loads((path / "run.json").read_text())
        cfg = run["config"]
        # a run's cache, or the first of a mixture's or an ensemble's (a run written before --cache
        # repeated held one path); their step-0 record is over all of them, so it is not this one's
        caches = cfg.get("ensemble") or ([cfg["cache"]] if isinstance(cfg["cache"], str) else cfg["cache"])
        cache = cache or caches[0]
        seq_len = seq_len if seq_len is not None else cfg["seq_len"]
        batch_size = batch_size or cfg.get("batch_size")  # the trainer's own evaluations batch so
        chunk_tokens = chunk_tokens if chunk_tokens is not None else cfg.get("chunk_tokens")
        tokenizer_dir = tokenizer or _run_tokenizer(path, cfg)
        reader = CacheReader(cache, expect_tokenizer_hash=None if tokenizer_dir else run.get("tokenizer_hash"))
        held = split_indices(reader.num_sequences, cfg["heldout"])[1]
        if heldout is None:
            held = held[:cfg["eval_sequences"]] if cfg.get("eval_sequences") else held
            initial_file = path / "initial_eval.json"
            if initial_file.exists() and len(caches) == 1:
                initial = EvalResult.from_dict(json.loads(initial_file.read_text()))
        else:
            held = split_indices(reader.num_sequences, heldout)[1]
        folder = path / "student"
        if not (folder / "config.json").exists():
            ckpt = latest_checkpoint(path)
            if ckpt is None:
                raise DistillUserError(f"run {path} has neither a final student nor a checkpoint to evaluate")
            folder = ckpt / "model"
    elif (path / "config.json").exists():
        if cache is None:
            raise DistillUserError(f"{path} is a student folder: pass the cache to evaluate it against")
        reader = CacheReader(cache)
        held = split_indices(reader.num_sequences, heldout)[1] if heldout else list(range(reader.num_sequences))
        folder, tokenizer_dir = path, tokenizer or path
    else:
        raise DistillUserError(f"{path} is neither a run directory (run.json) nor an HF folder (config.json)")
    if not held:
        raise DistillUserError("no sequences to evaluate: `heldout` is 0")
    # a student of another tokenizer reads the cache through the cross-tokenizer path (its mapped targets)
    student_tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    cross = None if student_tokenizer is None else open_cross_tokenizer(reader, student_tokenizer, "auto")
    if cross is not None and teacher is not None:
        raise DistillUserError("--teacher: the teacher model reads the teacher's tokens; a student of another "
                               "tokenizer is evaluated against the cache alone: leave --teacher out")
    model = Student.from_pretrained(folder, device=device)
    vocab = reader.manifest.spec.tokenizer.vocab_size if cross is None else len(student_tokenizer)
    if model.config.vocab_size < vocab:
        raise DistillUserError(f"student {folder} has vocab {model.config.vocab_size}, smaller than its tokenizer's "
                               f"{vocab}; pass --tokenizer, the folder of the tokenizer it was trained with")
    amp = torch.bfloat16 if resolve_dtype("auto", device) == "bfloat16" else None
    table_V = token_bytes_of(tokenizer_dir, student_tokenizer) if tokenizer_dir is not None else None
    # the teacher's row counts the bytes of the teacher's own tokens
    teacher_table = table_V if cross is None else cross.aligner.teacher.lengths
    options = dict(batch_size=batch_size or 8, device=device, seq_len=seq_len, autocast_dtype=amp,
                   long=LongContextConfig(chunk_tokens=chunk_tokens), progress=progress, token_bytes=table_V,
                   batches=batches_for(cross))
    reference = teacher_reference(reader, held, seq_len=seq_len, token_bytes=teacher_table)
    notes = {"kl_note": kl_note(reader, cross is not None)}
    if table_V is not None:
        notes["bits_per_byte_note"] = BITS_PER_BYTE_NOTE
    if teacher is None:
        student = evaluate_student(model, reader, held, **options)
    else:
        student, teacher_ece = evaluate_against_teacher(model, teacher(reader, device), reader, held, **options)
        reference = replace(reference, full_vocab_kl=0.0, calibration_error=teacher_ece)
        notes["full_vocab_note"] = FULL_VOCAB_NOTE
    result = {"teacher": reference}
    if is_run:
        result.update(before=initial, after=student, run=_run_summary(path, cfg))
    else:
        result["student"] = student
    return {**result, "cache": str(cache), "num_sequences": len(held), **notes}


def _run_tokenizer(path: Path, cfg: dict) -> Path | None:
    """The tokenizer folder of run `path`: the one it trained with (run.json) while it exists, else
    its final student's (saved with the tokenizer); None, with a warning, when neither is there."""
    for folder in (cfg.get("tokenizer"), path / "student"):
        if folder and any((Path(folder) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
            return Path(folder)
    logger.warning("no bits per byte for run %s: its tokenizer folder %s is gone and it has no final student; "
                   "pass --tokenizer", path, cfg.get("tokenizer"))
    return None


def _run_summary(path: Path, cfg: dict) -> dict:
    """The run's optimizer and its state bytes (from the last training row of metrics.jsonl); for a
    sparse FFN run also its L1 coefficient and the kernel's overflow / fallback rows summed over
    every logged step (per layer)."""
    state, overflow, fallback = None, None, None
    metrics = path / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if row.get("kind") == "train" and "optimizer_state_bytes" in row:
                state = row["optimizer_state_bytes"]
            if row.get("kind") == "train" and "ffn_overflow_rows" in row:
                add = lambda total, new: new if total is None else [a + b for a, b in zip(total, new)]
                overflow = add(overflow, row["ffn_overflow_rows"])
                fallback = add(fallback, row["ffn_fallback_rows"])
    summary = {"optimizer": cfg.get("optimizer", "adamw"), "optimizer_state_bytes": state, "steps": cfg.get("steps")}
    if cfg.get("sparse_ffn") or overflow is not None:
        summary.update(sparse_ffn=bool(cfg.get("sparse_ffn")), l1=cfg.get("l1"), ffn_overflow_rows=overflow,
                       ffn_fallback_rows=fallback)
    return summary
