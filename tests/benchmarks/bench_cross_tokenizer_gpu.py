"""Cross-tokenizer training's speed on the GPU: the fused loss on mapped targets, and whether the
alignment on the host keeps the GPU fed.

Setup: the standard library's .py text tokenized by a real teacher tokenizer (--teacher-tokenizer,
e.g. SmolLM2's) into one cache, and by a student byte-level BPE trained on the same text
(bench_cross_tokenizer.train_bpe) into another; both caches hold random but valid top-k targets
(distinct ids, descending log-probabilities, 90% of the mass in the top-k) written by the real
CacheWriter, the first with its tokenizer files. A random-init student of the SmolLM2-135M shape
with the student tokenizer's vocabulary.

Rows `cross_tokenizer_gpu/<case>`:
  loss/same, loss/mapped   fused_topk_kl forward + backward on the same N rows, hidden and
                           lm-head (bf16), the targets of a same-tokenizer batch against the
                           teacher's mapped onto the student's vocabulary (fillers included);
                           goal: mapped within 5% of same
  data/cross               the host's batches alone: student tokens/s of CrossTokenizerBatches
                           (alignment and mapping, one thread), and of CacheBatches (data/same)
  train/same, train/cross  `student.trainer.train` end to end, tokens/s over its logging windows
                           after the first: the student on its own tokenizer's cache against the
                           same student on the teacher's cache through alignment (train/cross-wN:
                           N prefetch threads instead of the default)

    python tests/benchmarks/bench_cross_tokenizer_gpu.py --teacher-tokenizer TOKENIZER_FOLDER --results $OUT/rows.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_cross_tokenizer import train_bpe
from bench_train_step_gpu import train_windows
from harness import Results, add_results_arg, time_cpu, time_gpu

from kernels.fused_topk_kl import fused_topk_kl
from student.config import StudentConfig
from student.cross_tokenizer.batches import CrossTokenizer, CrossTokenizerBatches
from student.data import CacheBatches, Prefetcher
from student.model import Student
from student.trainer import TrainConfig
from teacher_cache.identity import tokenizer_info
from teacher_cache.reader import CacheReader
from teacher_cache.targets import TeacherTargets
from teacher_cache.tokenizer_files import save_tokenizer_files
from teacher_cache.writer import CacheWriter

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)


def packed(tokenizer, seq_len: int, num_seqs: int) -> list[np.ndarray]:
    """The standard library's .py files in sorted order, tokenized and joined by the EOS id, cut into
    `num_seqs` sequences of `seq_len` ids."""
    ids, need = [], seq_len * num_seqs
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids += tokenizer(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id]
        if len(ids) >= need:
            break
    return [np.asarray(ids[i * seq_len:(i + 1) * seq_len], np.int32) for i in range(num_seqs)]


def write_cache(path: Path, tokenizer, seqs: list[np.ndarray], k: int, *, store_tokenizer: bool, seed: int = 0,
                fingerprint: str | None = None):
    """A parquet cache of `seqs` with random but valid top-k targets over the tokenizer's ids (seeded
    by `seed`; the data fingerprint f<seed> unless given: two caches of the same `seqs` and fingerprint
    are one corpus scored by two teachers)."""
    rng = np.random.default_rng(seed)
    info = tokenizer_info(tokenizer)
    vocab, seq_len = info["vocab_size"], len(seqs[0])
    spec = {
        "teacher": {"path": "synthetic", "weights_hash": "w0", "backend": "hf", "dtype": "bfloat16"},
        "tokenizer": {"hash": info["hash"], "vocab_size": vocab, "special_ids": info["special_ids"]},
        "data": {"source": "stdlib", "fingerprint": fingerprint or f"f{seed}", "sequences": len(seqs),
                 "tokens": len(seqs) * seq_len, "seq_len": seq_len},
        "targets": {"k": k, "value_codec": "fp32", "temperature": 1.0},
        "storage": {"format": "parquet", "shard_size": 8},
    }
    with CacheWriter(path, spec) as writer:
        if store_tokenizer:
            writer.set_tokenizer_files(save_tokenizer_files(tokenizer, path)["files"])
        for shard in range(writer.num_shards):
            part = seqs[shard * 8:(shard + 1) * 8]
            targets = []
            for _ in part:
                offsets = rng.choice(vocab, k, replace=False)  # distinct per row, shifted row by row
                ids = ((rng.integers(0, vocab, seq_len)[:, None] + offsets[None]) % vocab).astype(np.int32)
                logits = -np.sort(-rng.standard_normal((seq_len, k)) * 2.0, axis=1)
                lp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True) + np.log(0.9)
                target = np.full(seq_len, -6.0, np.float32)
                target[-1] = np.nan
                targets.append(TeacherTargets(ids, lp.astype(np.float32), np.full(seq_len, np.log(0.1), np.float32),
                                              target))
            writer.write_shard(shard, part, TeacherTargets.concat(targets))
        writer.finalize()


def save_random_student(folder: Path, tokenizer, device: str) -> dict:
    """A seeded random-init student of the SmolLM2-135M shape (on the CPU: a toy one) and the
    tokenizer's vocabulary, saved with the tokenizer in `folder`; its shape."""
    torch.manual_seed(0)
    shape = SHAPE if device == "cuda" else {**SHAPE, "num_layers": 1, "hidden_size": 64, "intermediate_size": 64,
                                            "num_heads": 2, "num_kv_heads": 1, "head_dim": 32}
    with torch.device(device):
        model = Student(StudentConfig(model_type="llama", vocab_size=len(tokenizer), rope_theta=100_000.0,
                                      max_position_embeddings=8192, tie_word_embeddings=True,
                                      extra={"eos_token_id": tokenizer.eos_token_id}, **shape))
    model.save_pretrained(folder)  # (a fresh folder), then the tokenizer beside the weights
    tokenizer.save_pretrained(folder)
    return shape


def host_rate(batches, count: int) -> float:
    """Student tokens/s of `count` batches handed out by the trainer's Prefetcher (its workers: the
    batches' prefetch_workers), nothing consuming them but this loop."""
    with Prefetcher(batches) as stream:
        for _ in range(batches.prefetch_workers + 1):  # every worker's first batch (its reader opens)
            next(stream)
        start, tokens = time.perf_counter(), 0
        for _ in range(count):
            tokens += next(stream).num_tokens
    return tokens / (time.perf_counter() - start)


def main():
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher-tokenizer", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=8192, help="the student tokenizer's size")
    ap.add_argument("--seq-len", type=int, default=2048, help="teacher tokens per cached sequence")
    ap.add_argument("--num-seqs", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--train-steps", type=int, default=20)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--workers", default="2,4", help="train/cross-wN rows: cross-tokenizer prefetch threads besides "
                                                      "the default's")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test at toy sizes, no figure")
    add_results_arg(ap)
    args = ap.parse_args()
    results = Results(bench="cross_tokenizer_gpu", path=args.results)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_xtok_"))
    teacher_tok = AutoTokenizer.from_pretrained(args.teacher_tokenizer)
    student_dir = work / "student"
    student_tok = AutoTokenizer.from_pretrained(train_bpe(work / "tokenizer", args.vocab))
    teacher_seqs = packed(teacher_tok, args.seq_len, args.num_seqs)
    # the student's cache holds as many sequences of about as much text (its tokens are shorter)
    ratio = sum(len(student_tok(teacher_tok.decode(s), add_special_tokens=False)["input_ids"])
                for s in teacher_seqs[:4]) / (4 * args.seq_len)
    student_seqs = packed(student_tok, int(args.seq_len * ratio), args.num_seqs)
    write_cache(work / "teacher_cache", teacher_tok, teacher_seqs, args.k, store_tokenizer=True)
    write_cache(work / "student_cache", student_tok, student_seqs, args.k, store_tokenizer=False, seed=1)
    shape = save_random_student(student_dir, student_tok, args.device)
    config = {"vocab": args.vocab, "seq_len": args.seq_len, "student_tokens_per_teacher_token": ratio,
              "batch_size": args.batch_size, "k": args.k, "shape": shape}

    cross = CrossTokenizer.between(teacher_tok, student_tok)
    same_reader, cross_reader = CacheReader(work / "student_cache"), CacheReader(work / "teacher_cache")
    indices = list(range(args.num_seqs))
    same_batches = CacheBatches(same_reader, indices, args.batch_size)
    cross_batches = CrossTokenizerBatches(cross_reader, indices, args.batch_size, cross=cross)
    for case, batches in (("data/same", same_batches), ("data/cross", cross_batches)):
        results.add(case, {"host_tok_s": host_rate(batches, 12), "workers": batches.prefetch_workers}, config)
    counts = cross_batches.counts
    results.add("alignment", {"aligned_share": counts["aligned"] / counts["positions"],
                              **{key: counts[key] for key in ("unencodable_bytes", "dropped_specials", "offset_runs")}},
                config)

    # the loss on the same rows: a same-tokenizer batch's targets against mapped ones
    device = args.device
    same, mapped = next(iter(same_batches)).to(device), next(iter(cross_batches)).to(device)
    n = min(same.topk_ids.shape[0], mapped.topk_ids.shape[0])
    g = torch.Generator(device=device).manual_seed(0)
    d = shape["hidden_size"]
    hidden = (torch.randn(n, d, device=device, generator=g) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(len(student_tok), d, device=device, generator=g) * 0.05).bfloat16().requires_grad_()
    mask = torch.ones(n, dtype=torch.bool, device=device)  # every row computed: the same work
    medians = {"loss/same": [], "loss/mapped": []}
    for _ in range(3):  # interleaved: a drift of the clock between the two falls on both
        for case, batch in (("loss/same", same), ("loss/mapped", mapped)):
            def step(batch=batch):
                loss = fused_topk_kl(hidden, weight, batch.topk_ids[:n], batch.topk_logprobs[:n],
                                     batch.tail_logmass[:n], mask=mask, tail="bucket", check_ids=False)
                loss.backward()

            timing = (time_gpu(step, warmup=3, repeats=20) if device == "cuda"
                      else time_cpu(step, warmup=1, repeats=2))
            medians[case].append(timing.median_ms)
    for case, values in medians.items():
        results.add(case, {"median_ms": statistics.median(values), "median_ms_rounds": values, "rows": n}, config)

    default_workers = CrossTokenizerBatches.prefetch_workers
    runs = [("train/same", "student_cache", default_workers)] + [
        ("train/cross" if w == default_workers else f"train/cross-w{w}", "teacher_cache", w)
        for w in sorted({default_workers, *map(int, args.workers.split(","))})]
    for case, cache, workers in runs:
        CrossTokenizerBatches.prefetch_workers = workers  # what the trainer's Prefetcher takes
        run = work / "run"
        if run.exists():
            import shutil

            shutil.rmtree(run)
        cfg = TrainConfig.from_flat(cache=str(work / cache), out=str(run), student=str(student_dir),
                                    tokenizer=str(student_dir), steps=args.train_steps,
                                    batch_size=args.batch_size, lr=3e-4, warmup_steps=2, heldout=1, eval_every=0,
                                    eval_sequences=1, save_every=0, log_every=4, device=args.device, seed=0)
        wall, windows = train_windows(cfg, work)
        results.add(case, {"tok_s": statistics.median(windows[1:]) if len(windows) > 1 else windows[0],
                           "tok_s_windows": windows, "wall_s": wall, "workers": workers}, config)


if __name__ == "__main__":
    main()
