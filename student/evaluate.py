"""Held-out evaluation of a student against the cached teacher, and of the teacher itself.

Everything is measured on cache rows: KL to the teacher over the k + 1 categories "top-k + tail"
(the training loss's own KL, student/loss.py, in its "bucket" form at the cache's temperature),
cross-entropy / perplexity on the actual next tokens, and top-1 agreement with the teacher; for a
ReLU-gated (sparse FFN) student also the per-layer sparsity and dead neurons on the same sequences.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from distill.devices import resolve_device, resolve_dtype
from distill.errors import DistillUserError
from student.checkpoint import latest_checkpoint
from student.data import Batch, CacheBatches, split_indices, tokenizer_info_of
from student.long_context import LongContextConfig, chunked_forward
from student.loss import LossConfig, distill_loss
from teacher_cache.reader import CacheReader

ROW_CHUNK = 1024  # rows of [rows, V] fp32 logits at a time for CE and top-1 (V = 49152: 200 MiB)
# Merging the vocabulary outside the teacher's top-k into one category can only lose information.
KL_NOTE = ("kl is a lower bound of the full-vocabulary KL(teacher || student): it is measured over the teacher's "
           "top-k ids plus one tail category, at the cache's temperature")
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

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None or not k.startswith("ffn_")}

    @classmethod
    def from_dict(cls, d: dict) -> EvalResult:
        """From to_dict() output or a metrics row (other keys ignored)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def summary(self) -> str:
        """One console line of the numbers."""
        return (f"KL to teacher (top-k bound) {self.kl:.4f}, CE {self.ce:.3f}, PPL {self.ppl:.2f}, "
                f"top-1 {self.top1:.3f} ({self.tokens:,} tokens)")


class _Sums:
    def __init__(self):
        self.kl = self.ce = self.top1 = 0.0
        self.rows = self.ce_rows = 0
        self.ffn = None  # sparse students: [nnz x rows summed [L], active [L, d_ff], rows]

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
        ffn = {}
        if self.ffn is not None:
            nnz = (self.ffn[0] / self.ffn[2]).tolist()
            ffn = {"ffn_nnz": nnz, "ffn_sparsity": [1 - n / d_ff for n in nnz],
                   "ffn_dead": (1 - self.ffn[1].float().mean(1)).tolist()}
        return EvalResult(kl=self.kl / max(self.rows, 1), ce=ce, ppl=math.exp(min(ce, 700.0)),
                          top1=self.top1 / max(self.rows, 1), tokens=self.rows, **ffn)


def _ce_and_top1(logits_CV, batch: Batch, rows: slice):
    """(sum CE, CE rows, sum top-1 hits) of one row chunk; logits fp32 [C, V]."""
    mask_C = batch.mask[rows]
    logq_CV = torch.log_softmax(logits_CV, dim=-1)
    target_C = batch.target_ids[rows]
    has_C = mask_C & (target_C >= 0)
    ce = -logq_CV.gather(1, target_C.clamp_min(0)[:, None])[:, 0][has_C].sum()
    hits = (logits_CV.argmax(-1) == batch.topk_ids[rows, 0])[mask_C].sum()
    return ce.item(), int(has_C.sum()), hits.item()


@torch.no_grad()
def evaluate_student(model, reader: CacheReader, indices, *, batch_size: int, device, seq_len: int | None = None,
                     autocast_dtype: torch.dtype | None = None, row_chunk: int = ROW_CHUNK,
                     long: LongContextConfig | None = None) -> EvalResult:
    """Evaluate `model` (a ``Student``) on sequences `indices` of `reader`, without gradients.

    kl: the training loss's KL (student/loss.py, the fused kernel, summed over rows): forward
    KL(teacher || student) at the cache's temperature over the k + 1 categories "the teacher's
    top-k ids plus one tail bucket" (the student's tail is its mass outside the top-k), a lower
    bound of the full-vocabulary KL (KL_NOTE). ce / ppl: cross-entropy of the actual next token
    (rows that have one). top1: agreement of the student's argmax with the teacher's top-1 id.
    For ce and top1 the logits are formed `row_chunk` rows at a time; the [tokens, V] logits never
    exist at once. seq_len crops each sequence to its first seq_len rows. With `long.chunk_tokens`
    the sequences run chunk by chunk against a paged key/value store, as in training (same
    results, the memory of one chunk). A ReLU-gated student also
    gets ffn_nnz / ffn_sparsity / ffn_dead per layer, counted over the real tokens of the batches
    (padding of ragged sequences left out).
    """
    was_training = model.training
    model.eval()
    sums = _Sums()
    data = CacheBatches(reader, indices, batch_size, seq_len=seq_len, shuffle=False)
    weight = model.lm_head_weight.float()
    cache_temperature = reader.manifest.spec.targets.temperature
    for whole in data.epoch_batches():
        input_ids, mask = whole.input_ids.to(device), whole.mask.to(device)
        for start, end, hidden, terms in chunked_forward(model, input_ids, mask, long or LongContextConfig(),
                                                         autocast_dtype=autocast_dtype):
            batch = whole.positions(start, end).to(device)
            hidden_ND = hidden.reshape(-1, hidden.shape[-1]).float()
            if terms:  # a ReLU-gated student: statistics over the real tokens (the padding rows left out)
                sums.add_ffn(terms, batch.num_tokens)
            _, kl = distill_loss(hidden_ND, weight, batch, _EVAL_LOSS, cache_temperature=cache_temperature,
                                 reduction="sum", check_ids=not str(device).startswith("cuda"))
            sums.kl += kl.item()
            for lo in range(0, hidden_ND.shape[0], row_chunk):
                rows = slice(lo, lo + row_chunk)
                ce, ce_rows, hits = _ce_and_top1(hidden_ND[rows] @ weight.T, batch, rows)
                sums.ce, sums.ce_rows, sums.top1 = sums.ce + ce, sums.ce_rows + ce_rows, sums.top1 + hits
            sums.rows += batch.num_tokens
    model.train(was_training)
    return sums.result(model.config.intermediate_size)


def teacher_reference(reader: CacheReader, indices, *, seq_len: int | None = None) -> EvalResult:
    """The teacher on the same rows, from the cache: ce from target_logprob, kl 0, top1 1."""
    sums = _Sums()
    for batch in CacheBatches(reader, indices, 64, seq_len=seq_len, shuffle=False).epoch_batches():
        has = batch.mask & (batch.target_ids >= 0)
        sums.ce -= batch.target_logprob[has].double().sum().item()
        sums.ce_rows += int(has.sum())
        sums.rows += batch.num_tokens
        sums.top1 += batch.num_tokens
    return sums.result()


def evaluate_run_or_folder(path, cache=None, heldout: int | None = None, *, batch_size: int | None = None,
                           device: str = "auto", seq_len: int | None = None, tokenizer=None,
                           chunk_tokens: int | None = None) -> dict:
    """`distill eval`: evaluate a run directory (its run.json gives the cache, held-out split,
    evaluation sequences, seq_len and batch size; its final student, else its latest checkpoint) or
    a student HF folder with `cache` (held-out: the `heldout` evenly spaced sequences, default all of
    them; batch size 8 unless given).

    The cache must be of the student's tokenizer, as train-student requires: a run's (run.json
    records its hash), or for a folder the one in `tokenizer` (default: the folder itself).

    Returns {"teacher": EvalResult, "before": EvalResult | None, "after": EvalResult} for a run
    directory ("before": its step-0 student, recorded by the trainer, on the same sequences; None
    when `heldout` asks for other ones) and {"teacher", "student"} for a folder, plus "cache" (str)
    and "num_sequences" (int). chunk_tokens: run long sequences chunk by chunk (default: as the
    run trained, whole sequences for a folder).
    """
    from student.model import Student

    path = Path(path)
    device = resolve_device(device)
    initial = None
    is_run = (path / "run.json").exists()
    if is_run:
        run = json.loads((path / "run.json").read_text())
        cfg = run["config"]
        cache = cache or cfg["cache"]
        seq_len = seq_len if seq_len is not None else cfg["seq_len"]
        batch_size = batch_size or cfg.get("batch_size")  # the trainer's own evaluations batch so
        chunk_tokens = chunk_tokens or cfg.get("chunk_tokens")
        if tokenizer is not None:
            tok = tokenizer_info_of(tokenizer)
            reader = CacheReader(cache, expect_vocab_size=tok["vocab_size"], expect_tokenizer_hash=tok["hash"])
        else:
            reader = CacheReader(cache, expect_tokenizer_hash=run.get("tokenizer_hash"))
        held = split_indices(reader.num_sequences, cfg["heldout"])[1]
        if heldout is None:
            held = held[:cfg["eval_sequences"]] if cfg.get("eval_sequences") else held
            initial_file = path / "initial_eval.json"
            if initial_file.exists():
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
        tok = tokenizer_info_of(tokenizer or path)
        reader = CacheReader(cache, expect_vocab_size=tok["vocab_size"], expect_tokenizer_hash=tok["hash"])
        held = split_indices(reader.num_sequences, heldout)[1] if heldout else list(range(reader.num_sequences))
        folder = path
    else:
        raise DistillUserError(f"{path} is neither a run directory (run.json) nor an HF folder (config.json)")
    if not held:
        raise DistillUserError("no sequences to evaluate: `heldout` is 0")
    model = Student.from_pretrained(folder, device=device)
    if model.config.vocab_size < reader.manifest.spec.tokenizer.vocab_size:
        raise DistillUserError(f"student {folder} has vocab {model.config.vocab_size}, smaller than the cache's "
                               f"{reader.manifest.spec.tokenizer.vocab_size}; evaluate it against a cache of its tokenizer")
    amp = torch.bfloat16 if resolve_dtype("auto", device) == "bfloat16" else None
    student = evaluate_student(model, reader, held, batch_size=batch_size or 8, device=device, seq_len=seq_len,
                               autocast_dtype=amp, long=LongContextConfig(chunk_tokens=chunk_tokens))
    result = {"teacher": teacher_reference(reader, held, seq_len=seq_len)}
    if is_run:
        result.update(before=initial, after=student, run=_run_summary(path, cfg))
    else:
        result["student"] = student
    return {**result, "cache": str(cache), "num_sequences": len(held)}


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
