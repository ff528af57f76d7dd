"""GPU smoke run of the trainer with a sparse FFN (ReLU gate + L1) on a 135M random-init student,
--sparse-kernel dense against twell, 30 steps each: both paths train end to end, and what the
TwELL kernels cost at the sparsity of a fresh ReLU gate (about 50%).

    # on the GPU machine, from a clean copy of HEAD in .gpucache/src3 with the cache and student
    # folders of bench_optimizer_convergence_gpu.py beside it:
    cd .gpucache/src3 && PYTHONPATH=$PWD python3 tests/benchmarks/smoke_sparse_ffn_gpu.py
"""

import json
import time
from pathlib import Path

import torch

from student.trainer import TrainConfig, train

for kernel in ("dense", "twell"):
    out = Path(f"/tmp/sparse_{kernel}")
    cfg = TrainConfig(cache="../stdlib512", student="../student135m", out=str(out), steps=30, batch_size=8,
                      warmup_steps=5, heldout=8, eval_every=15, log_every=5, save_every=0, sparse_ffn=True,
                      l1=2e-5, sparse_kernel=kernel, seed=0)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    report = train(cfg, progress=False)
    dt = time.perf_counter() - t0
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    tr = [r for r in rows if r["kind"] == "train"]
    ev = [r for r in rows if r["kind"] == "eval"]
    last = tr[-1]
    print(f"{kernel}: {dt:.1f} s, peak {torch.cuda.max_memory_allocated()/2**30:.2f} GiB, tok/s {[round(r['tok_per_s']) for r in tr]}")
    print(f"  loss {last['loss']:.4f} kl {last['kl']:.4f} l1 {last['l1']:.1f}")
    print(f"  nnz {[round(x) for x in last['ffn_nnz']][:8]}... sparsity mean {sum(last['ffn_sparsity'])/len(last['ffn_sparsity']):.3f}")
    print(f"  overflow {sum(last['ffn_overflow_rows'])} fallback {sum(last['ffn_fallback_rows'])} dead mean {sum(last['ffn_dead'])/len(last['ffn_dead']):.4f}")
    print(f"  eval {[(r['step'], round(r['kl'], 4)) for r in ev]}")
