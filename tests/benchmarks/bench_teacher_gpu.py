"""Stage one on a GPU, side by side in one run: the obvious teacher pass a user would write
(transformers forward in bf16, full logits, fp32 log-softmax, top-k, copy to host, nothing
written) against `build_cache` with the hf backend writing a finished cache to disk.

Random weights with the SmolLM2-135M and Qwen2-0.5B shapes (speed depends on the shape only),
random token ids. Run on the GPU machine from the repo root:

    PYTHONPATH=. python tests/benchmarks/bench_teacher_gpu.py --out /tmp/bench

Prints a table and writes bench_teacher_gpu.json next to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from teacher_cache.backends.hf import HFBackend
from teacher_cache.build import CacheConfig, build_cache

SHAPES = {
    # name: (hidden, vocab, layers, heads, kv_heads, intermediate)
    "smollm2-135m": (576, 49152, 30, 9, 3, 1536),
    "qwen2-0.5b": (896, 151936, 24, 14, 2, 4864),
}


def save_random_model(shape: str, folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    d, v, layers, heads, kv, inter = SHAPES[shape]
    common = dict(hidden_size=d, vocab_size=v, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=4096,
                  tie_word_embeddings=True)
    torch.manual_seed(0)
    cls, cfg = (Qwen2ForCausalLM, Qwen2Config) if shape.startswith("qwen") else (LlamaForCausalLM, LlamaConfig)
    model = cls(cfg(**common)).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


@torch.inference_mode()
def obvious_pass(model_dir: Path, seqs: list[np.ndarray], k: int, batch: int) -> float:
    """tokens/s of the plain pass; model load and one warm-up batch excluded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.from_numpy(np.stack(seqs)).cuda()

    def run(rows):
        for b in range(0, len(rows), batch):
            logp = model(rows[b:b + batch]).logits.float().log_softmax(-1)
            vals, idx = logp.topk(k, dim=-1)
            vals.cpu(), idx.cpu()

    run(ids[:batch])
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        run(ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del model
    torch.cuda.empty_cache()
    return ids.numel() / statistics.median(times)


def ours(model_dir: Path, seqs, k, out: Path, variant: str) -> dict:
    """End to end to a finished cache on disk; backend load and a warm-up build excluded.

    variant: "+"-joined options: torch | triton (lm-head top-k path), compile (torch.compile the
    body), parquet (else zarr), wN (N writer threads, else the default).
    """
    opts = variant.split("+")
    threads = next((int(o[1:]) for o in opts if o.startswith("w") and o[1:].isdigit()), 0)
    batch = next((int(o[1:]) for o in opts if o.startswith("b") and o[1:].isdigit()), 8)
    per_call = batch * next((int(o[1:]) for o in opts if o.startswith("p") and o[1:].isdigit()), 1)
    cache_kwargs = dict(k=k, shard_size=max(8, per_call), batch_size=per_call, writer_threads=threads,
                        storage="parquet" if "parquet" in opts else "zarr")
    backend = HFBackend(model_dir, dtype="bfloat16", device="cuda", impl="triton" if "triton" in opts else "torch",
                        compile="compile" in opts, batch_size=batch)
    identity = dict(tokenizer={"hash": "random-token-ids", "vocab_size": backend.vocab_size, "special_ids": {}},
                    data={"source": "random token ids", "fingerprint": "random", "seq_len": len(seqs[0])})
    warm = out.with_name(out.name + "-warmup")
    for path in (warm, out):
        shutil.rmtree(path, ignore_errors=True)
    build_cache(seqs[:16], backend, CacheConfig(out=warm, **cache_kwargs), progress=False, **identity)
    torch.cuda.synchronize()
    report = build_cache(seqs, backend, CacheConfig(out=out, **cache_kwargs), progress=False, **identity)
    t0 = time.perf_counter()
    for b in range(0, len(seqs), per_call):
        backend.score(seqs[b:b + per_call], k)
    teacher_only = sum(len(s) for s in seqs) / (time.perf_counter() - t0)
    backend.close()
    disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {
        "tok_s": report.tokens_per_second, "teacher_only_tok_s": teacher_only,
        "teacher_s": report.teacher_seconds, "writer_s": report.writer_seconds,
        "writer_wait_s": report.writer_wait_seconds, "wall_s": report.wall_seconds,
        "bytes_per_token": disk / report.tokens_scored,
    }


@torch.inference_mode()
def check_kernel(shape: str, k: int) -> dict:
    """The Triton top-k path against the torch reference at the benchmark shape, on this GPU."""
    from kernels.topk_logprobs import topk_logprobs

    d, v = SHAPES[shape][:2]
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(4093, d, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(v, d, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    next_ids = torch.randint(-1, v, (4093,), device="cuda", generator=gen)
    ref = topk_logprobs(hidden, weight, k, next_ids, impl="torch")
    out = topk_logprobs(hidden, weight, k, next_ids, impl="triton", chunk_size=1000)
    same_ids = (ref[0].sort(-1).values == out[0].sort(-1).values).float().mean().item()
    errs = [(a - b).abs().nan_to_num().max().item() for a, b in zip(ref[1:], out[1:])]
    return {"shape": shape, "id_set_agreement": same_ids, "max_abs_err_logprobs": errs[0],
            "max_abs_err_tail": errs[1], "max_abs_err_target": errs[2]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_teacher"))
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--variants", default="torch,triton,triton+compile")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    results, checks = [], [check_kernel(shape, args.k) for shape in shapes]
    for c in checks:
        print("kernel check:", c)
    for shape in shapes:
        model_dir = save_random_model(shape, args.out / "models" / shape)
        rng = np.random.default_rng(0)
        seqs = [rng.integers(0, SHAPES[shape][1], args.seq_len).astype(np.int32) for _ in range(args.sequences)]
        base = obvious_pass(model_dir, seqs, args.k, batch=8)
        results.append({"shape": shape, "variant": "obvious pass (nothing written)", "tok_s": base})
        for variant in args.variants.split(","):
            r = ours(model_dir, seqs, args.k, args.out / f"cache-{shape}-{variant}", variant)
            results.append({"shape": shape, "variant": f"build_cache {variant}", **r, "speedup": r["tok_s"] / base})
        shutil.rmtree(args.out / "models" / shape)
    print(f"{'shape':14s} {'variant':40s} {'tok/s':>10s} {'x obvious':>9s} {'teacher-only':>12s} "
          f"{'teacher s':>9s} {'writer s':>8s} {'wait s':>7s} {'B/tok':>6s}")
    for r in results:
        print(f"{r['shape']:14s} {r['variant']:40s} {r['tok_s']:10,.0f} {r.get('speedup', 1):9.2f} "
              f"{r.get('teacher_only_tok_s', 0):12,.0f} {r.get('teacher_s', 0):9.2f} {r.get('writer_s', 0):8.2f} "
              f"{r.get('writer_wait_s', 0):7.2f} {r.get('bytes_per_token', 0):6.0f}")
    (args.out / "bench_teacher_gpu.json").write_text(json.dumps({"checks": checks, "results": results}, indent=2))


if __name__ == "__main__":
    main()
