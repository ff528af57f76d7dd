"""FSDP2 training throughput at 1, 2, 4, 8 GPUs of one host: `distill train-student` itself under
`torchrun --nproc-per-node N`, the same run (same global batch) at every world size.

Setup: a random-init student of the Llama-3.2-3B shape (hidden 3,072, 28 layers, 24 / 8 heads,
intermediate 8,192, vocab 128,256, tied embeddings) saved as an HF folder with a word-level
tokenizer, and a parquet teacher cache of random but valid targets (bench_train_step_gpu.py's
writer). Each world size N trains `--steps` steps of the same global batch (--global-batch
sequences of --seq-len tokens, default the largest N) as --batch-size N (one sequence a GPU) x
--grad-accum global/N, AdamW, bf16 autocast, evaluation of one held-out sequence at the start and end.

Rows `fsdp_scaling/<shape>-T<seq_len>/gpus<N>`: tokens/s over the logging windows after the
first (the trainer's tok_per_s rows: data loading and host syncs included), the scaling
efficiency tokens/s / (N x tokens/s at the smallest world size measured), the peak GPU memory of
rank 0, the wall time of the whole command. Before any figure is kept, the first step's loss at
every world size is checked against the smallest world size's (the same global batch: equal up to
the order of fp32 sums, tests/test_distributed.py).

    PYTHONPATH=. python tests/benchmarks/bench_fsdp_scaling_gpu.py --results $OUT/results.jsonl

On a CPU, `--device cpu --shape tiny --seq-len 64 --gpus 1,2` runs the same launches with gloo at
a toy size (a smoke test, not a figure).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_train_step_gpu import make_tokenizer, write_cache
from harness import Results, add_results_arg, check_close
from run_helpers import torchrun, world_sizes

from student.config import StudentConfig
from student.model import Student

REPO = Path(__file__).resolve().parents[2]
SHAPES = {
    "llama-3b": dict(vocab_size=128_256, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
                     num_kv_heads=8, head_dim=128, rope_theta=500_000.0, max_position_embeddings=131_072),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16),  # CPU smoke test only
}


def launch(nproc: int, global_batch: int, args, work: Path, out: Path) -> float:
    """One `distill train-student` run on `nproc` processes; returns its wall seconds."""
    run = torchrun(nproc) if nproc > 1 else [sys.executable]
    command = [*run, "-m", "distill", "train-student", "--cache", str(work / "cache"), "--student",
               str(work / "student"), "--out", str(out), "--steps", str(args.steps), "--batch-size", str(nproc),
               "--grad-accum", str(global_batch // nproc),
               "--lr", "3e-4", "--warmup-steps", "2", "--heldout", "1", "--eval-sequences", "1", "--eval-every", "0",
               "--save-every", "0", "--log-every", str(args.log_every), "--device", args.device, "--seed", "0",
               "--quiet"]
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{nproc} processes failed:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3b", choices=tuple(SHAPES))
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--gpus", default="1,2,4,8", help="world sizes, comma-separated (those above the GPUs seen are skipped)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: the largest world size)")
    parser.add_argument("--log-every", type=int, default=3, help="steps per tokens/s window (the first is dropped)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rtol", type=float, default=2e-2, help="first-step loss vs the smallest world size's (bf16)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the student, cache and runs (default: a temp dir)")
    add_results_arg(parser)
    args = parser.parse_args()
    sizes = world_sizes(args.gpus, args.device)
    if args.steps < 2 * args.log_every:
        raise SystemExit("--steps must hold two --log-every windows (the first is dropped)")
    global_batch = args.global_batch or max(sizes)
    if any(global_batch % n for n in sizes):
        raise SystemExit(f"--global-batch {global_batch} must divide by every world size of --gpus {args.gpus}")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_fsdp_scaling_"))
    torch.manual_seed(0)
    config = StudentConfig(model_type="llama", tie_word_embeddings=True, extra={"bos_token_id": 1, "eos_token_id": 2},
                           **SHAPES[args.shape])
    with torch.device(args.device):  # random init on the device: seconds instead of minutes on the host
        student = Student(config)
    params = sum(p.numel() for p in student.parameters())
    student.save_pretrained(work / "student")
    del student
    tok = make_tokenizer(work / "student", config.vocab_size)
    write_cache(work / "cache", tok, global_batch * args.steps + 1, args.seq_len, min(100, tok["vocab_size"] // 4),
                shard_size=8)
    results = Results(bench="fsdp_scaling", path=args.results)
    base_tok_s, base_loss, base_n = None, None, None
    for n in sizes:
        out = work / f"run{n}"
        wall_s = launch(n, global_batch, args, work, out)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        train_rows = [r for r in rows if r["kind"] == "train"]
        first = json.loads((out / "run.json").read_text())  # the run's resolved config, for the row
        loss = train_rows[0]["loss"]
        if base_loss is None:
            base_loss, base_n = loss, n
        check_close(f"step-1 loss at {n} vs {base_n} processes", torch.tensor(loss), torch.tensor(base_loss),
                    atol=0.0, rtol=args.rtol)
        tok_s = statistics.median(r["tok_per_s"] for r in train_rows[1:])
        base_tok_s = base_tok_s or tok_s / n
        figures = {"tok_per_s": tok_s, "scaling": tok_s / (n * base_tok_s), "step1_loss": loss,
                   "peak_gpu_gib": max((r.get("peak_gpu_bytes", 0) for r in train_rows), default=0) / 2**30,
                   "wall_s": wall_s}
        results.add(f"{args.shape}-T{args.seq_len}/gpus{n}", figures,
                    {"shape": {**SHAPES[args.shape], "parameters": params}, "seq_len": args.seq_len, "world_size": n,
                     "global_batch": global_batch, "steps": args.steps, "train": first["config"]})
        shutil.rmtree(out)  # the final checkpoint of a 3B run is tens of GB


if __name__ == "__main__":
    main()
