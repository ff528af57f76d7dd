"""Stage one on a GPU, side by side in one run: the plain teacher pass a user would write
(transformers forward in bf16, full logits, fp32 log-softmax, top-k, copy to the host, nothing
written) against `build_cache` with the hf backend writing a finished cache to disk.

Random weights with the SmolLM2-135M and Qwen2-0.5B shapes (the speed depends on the shape only)
and random token ids. Before any timing, the Triton lm-head top-k (`kernels/topk_logprobs.py`) is
checked at each shape against its torch reference and against the log-softmax of the same logits
(every returned id carries its own log-probability; ties at the k-th place may pick other ids).
Cached values are not compared with the plain pass: random weights give near-uniform teacher
distributions, on which such a comparison could not fail.

Rows, `teacher_gpu/<shape>/<variant>`: "plain" (the plain pass, over --plain-sequences, whose
speed does not depend on the run's length), then one per --variants entry, each a whole
`build_cache` of --sequences after an untimed 16-sequence warm-up build: "default" (the hf backend
and `CacheConfig` as `distill cache-teacher` runs them on a GPU, the model body compiled) or
"+"-joined options: compile (`--compile`), eager (`--no-compile`), zarr (Zarr storage), torch
(the torch top-k path), sN (shards of N sequences), bN (N sequences a teacher call), wN (N writer threads), rsN (a sampled
cache, `--targets sampled --samples N`: kernels/sample_targets.py in place of the top-k). Model TFLOP/s
count 2 x parameters + causal attention (2 x layers x seq_len x hidden) per token, against the
bf16 matmul ceiling. --profile adds `teacher_gpu/<shape>/profile/<part>`: one 8 x seq_len batch
of the plain pass, split into the model body, the lm-head matmul, the fp32 log-softmax and the
top-k, beside our lm-head + top-k (the Triton path), where the time of a teacher pass goes.

    PYTHONPATH=. python tests/benchmarks/bench_teacher_gpu.py --results $OUT/results.jsonl
    PYTHONPATH=. python tests/benchmarks/bench_teacher_gpu.py --shapes qwen2-0.5b --variants compile+s8 --profile

On a CPU, `--device cpu --shapes tiny` runs every step at a toy size (a smoke test, not a figure;
the kernel check then needs TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from harness import Results, add_results_arg, ceilings, check_close, gbps, tflops, time_cpu, time_gpu

from teacher_cache.backends.hf import HFBackend
from teacher_cache.build import CacheConfig, build_cache

SHAPES = {
    # name: (hidden, vocab, layers, heads, kv_heads, intermediate)
    "smollm2-135m": (576, 49152, 30, 9, 3, 1536),
    "qwen2-0.5b": (896, 151936, 24, 14, 2, 4864),
    "tiny": (64, 512, 2, 4, 2, 128),  # CPU smoke test only
}
PLAIN_BATCH = 8  # sequences per forward of the plain pass, as the hf backend's default batch


def timer(device: str):
    return time_gpu if device == "cuda" else time_cpu


def free_memory(device: str) -> None:
    """Give a finished part's memory back (compiled graphs included), so the next part's peak is its own."""
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def save_random_model(shape: str, folder: Path, device: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    d, v, layers, heads, kv, inter = SHAPES[shape]
    cls, cfg = (Qwen2ForCausalLM, Qwen2Config) if shape.startswith("qwen") else (LlamaForCausalLM, LlamaConfig)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg(hidden_size=d, vocab_size=v, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=4096,
                        tie_word_embeddings=True))
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def model_flops_per_token(shape: str, seq_len: int) -> float:
    d, v, layers, heads, kv, inter = SHAPES[shape]
    head_dim = d // heads
    per_layer = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d + 3 * d * inter
    return 2 * (layers * per_layer + v * d) + 2 * layers * seq_len * d


def rates(flops: float, ms: float, ceiling: dict | None) -> dict:
    out = {"tflops": tflops(flops, ms)}
    if ceiling:
        out["of_matmul_ceiling"] = out["tflops"] / ceiling["matmul_bf16_tflops"]
    return out


@torch.inference_mode()
def check_kernel(shape: str, k: int, device: str) -> dict:
    """The Triton top-k against the torch reference on peaked random logits at the shape's d and V:
    log-probabilities, tail and target to 1e-4 nats; each returned id's own log-probability."""
    from kernels.topk_logprobs import topk_logprobs

    d, v = SHAPES[shape][:2]
    rows, chunk = (4093, 1000) if device == "cuda" else (37, 16)
    gen = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(rows, d, device=device, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(v, d, device=device, generator=gen) * 0.1).to(torch.bfloat16)
    next_ids = torch.randint(-1, v, (rows,), device=device, generator=gen)
    ref = topk_logprobs(hidden, weight, k, next_ids, impl="torch", chunk_size=chunk)
    ids, lp, tail, target = topk_logprobs(hidden, weight, k, next_ids, impl="triton", chunk_size=chunk)
    errors = {"logprobs": check_close(f"{shape} top-k log-probs", lp, ref[1], atol=1e-4),
              "tail": check_close(f"{shape} tail", tail, ref[2], atol=1e-4),
              "target": check_close(f"{shape} target", target, ref[3], atol=1e-4)}
    own = torch.cat([(hidden[s:s + chunk] @ weight.T).float().log_softmax(-1).gather(1, ids[s:s + chunk].long())
                     for s in range(0, rows, chunk)])
    errors["own_logprob_of_ids"] = check_close(f"{shape} log-prob of the returned ids", lp, own, atol=1e-4)
    sorted_ids = ids.sort(-1).values
    if bool((sorted_ids[:, 1:] == sorted_ids[:, :-1]).any()):
        raise AssertionError(f"{shape}: a row of the Triton top-k repeats an id")
    errors["id_set_agreement"] = (sorted_ids == ref[0].sort(-1).values).float().mean().item()
    return errors


def plain_pass(model_dir: Path, seqs: list[np.ndarray], k: int, device: str, repeats: int):
    """The plain pass over `seqs`; one warm-up batch, then `repeats` timed passes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    ids = torch.from_numpy(np.stack(seqs)).to(device)

    @torch.inference_mode()
    def run(rows):
        for b in range(0, len(rows), PLAIN_BATCH):
            logp = model(rows[b:b + PLAIN_BATCH]).logits.float().log_softmax(-1)
            vals, idx = logp.topk(k, dim=-1)
            vals.cpu(), idx.cpu()

    run(ids[:PLAIN_BATCH])
    return timer(device)(lambda: run(ids), warmup=0, repeats=repeats)


def parse_variant(variant: str) -> tuple[dict, dict]:
    """"default" or "+"-joined options -> (HFBackend overrides, CacheConfig overrides)."""
    backend, cache = {}, {}
    for opt in [] if variant == "default" else variant.split("+"):
        number = int(opt[1:]) if opt[1:].isdigit() else None
        if opt == "compile":
            backend["compile"] = True
        elif opt == "eager":
            backend["compile"] = False
        elif opt == "torch":
            backend["impl"] = "torch"
        elif opt == "zarr":
            cache["storage"] = "zarr"
        elif opt[0] == "s" and number:
            cache["shard_size"] = number
        elif opt[0] == "b" and number:
            backend["batch_size"] = cache["batch_size"] = number
        elif opt[0] == "w" and number:
            cache["writer_threads"] = number
        elif opt[:2] == "rs" and opt[2:].isdigit():
            cache["targets"], cache["samples"] = "sampled", int(opt[2:])
        else:
            raise SystemExit(f"unknown variant option {opt!r} in {variant!r}: default, or + of compile, torch, zarr, "
                             "sN, bN, wN, rsN")
    return backend, cache


def ours(model_dir: Path, seqs, k: int, work: Path, variant: str, device: str) -> tuple[dict, dict]:
    """End to end to a finished cache on disk; backend load and a 16-sequence warm-up build excluded."""
    backend_kw, cache_kw = parse_variant(variant)
    backend = HFBackend(model_dir, dtype="bfloat16", device=device, **backend_kw)
    identity = dict(tokenizer={"hash": "random-token-ids", "vocab_size": backend.vocab_size, "special_ids": {}},
                    data={"source": "random token ids", "fingerprint": "random", "seq_len": len(seqs[0])})
    warm, out = work / f"warmup-{variant}", work / f"cache-{variant}"
    for path in (warm, out):
        shutil.rmtree(path, ignore_errors=True)
    build_cache(seqs[:16], backend, CacheConfig(out=warm, k=k, **cache_kw), progress=False, **identity)
    config = CacheConfig(out=out, k=k, **cache_kw)
    if device == "cuda":
        torch.cuda.synchronize()
    report = build_cache(seqs, backend, config, progress=False, **identity)
    sampled = lambda b: {} if config.sampling is None else {
        "sampling": config.sampling, "indices": list(range(b, min(b + config.batch_size, len(seqs))))}
    teacher = timer(device)(lambda: [backend.score(seqs[b:b + config.batch_size], config.slots, **sampled(b))
                                     for b in range(0, len(seqs), config.batch_size)], warmup=0, repeats=1)
    backend.close()
    disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    for path in (warm, out):
        shutil.rmtree(path, ignore_errors=True)
    figures = {"tok_s": report.tokens_per_second, "wall_s": report.wall_seconds,
               "teacher_only_tok_s": report.tokens_scored / (teacher.median_ms / 1e3),
               "teacher_s": report.teacher_seconds, "writer_s": report.writer_seconds,
               "writer_wait_s": report.writer_wait_seconds, "bytes_per_token": disk / report.tokens_scored}
    return figures, {"backend": {"dtype": "bfloat16", **backend_kw}, "cache": dataclasses.asdict(config)}


@torch.inference_mode()
def profile(results: Results, shape: str, model_dir: Path, seq_len: int, k: int, device: str, ceiling, base: dict):
    """Where one plain-pass batch's time goes, beside our lm-head + top-k on the same hidden states."""
    from transformers import AutoModelForCausalLM

    from kernels.topk_logprobs import topk_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    d, v = SHAPES[shape][:2]
    ids = torch.randint(0, v, (PLAIN_BATCH, seq_len), device=device, generator=torch.Generator(device=device).manual_seed(2))
    n = ids.numel()
    weight = model.get_output_embeddings().weight
    hidden = model.get_decoder()(ids).last_hidden_state.reshape(n, d)
    logits = hidden @ weight.T
    logp = logits.float().log_softmax(-1)
    next_ids = torch.cat([ids[:, 1:], torch.full((PLAIN_BATCH, 1), -1, device=device)], 1).reshape(-1)
    parts = {  # part: (function, figures beyond the time)
        "plain-batch": (lambda: [t.cpu() for t in model(ids).logits.float().log_softmax(-1).topk(k, dim=-1)],
                        lambda ms: rates(model_flops_per_token(shape, seq_len) * n, ms, ceiling)),
        "body": (lambda: model.get_decoder()(ids).last_hidden_state,
                 lambda ms: rates((model_flops_per_token(shape, seq_len) - 2 * v * d) * n, ms, ceiling)),
        "lm-head-matmul": (lambda: hidden @ weight.T, lambda ms: rates(2 * n * v * d, ms, ceiling)),
        # bf16 logits read, their fp32 copy written and read, the log-probs written: 14 B a logit
        "log-softmax-fp32": (lambda: logits.float().log_softmax(-1), lambda ms: {"gbps": gbps(14 * n * v, ms)}),
        "topk-of-fp32": (lambda: logp.topk(k, dim=-1), lambda ms: {"gbps": gbps(4 * n * v, ms)}),
        "ours-head-triton": (lambda: topk_logprobs(hidden, weight, k, next_ids, check_ids=False),
                             lambda ms: rates(2 * n * v * d, ms, ceiling)),
    }
    for part, (fn, extra) in parts.items():
        timing = timer(device)(fn, warmup=3, repeats=10)
        results.add(f"{shape}/profile/{part}", {**timing.figures(), "tok_s": n / (timing.median_ms / 1e3),
                                                **extra(timing.median_ms)}, {**base, "rows": n})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,qwen2-0.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--variants", default="default,eager", help="comma-separated; see the module docstring")
    parser.add_argument("--sequences", type=int, default=1024, help="sequences each build_cache variant writes")
    parser.add_argument("--plain-sequences", type=int, default=256, help="sequences of each timed plain pass")
    parser.add_argument("--plain-repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--profile", action="store_true", help="also time the parts of one plain-pass batch")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--work", type=Path, default=None, help="folder for models and caches (default: a temp dir)")
    add_results_arg(parser)
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    for variant in args.variants.split(","):
        parse_variant(variant)
    import transformers

    results = Results(bench="teacher_gpu", path=args.results)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_teacher_gpu_"))
    ceiling = ceilings() if args.device == "cuda" else None
    checks = {shape: check_kernel(shape, args.k, args.device) for shape in shapes}
    print("kernel checks passed:", checks, flush=True)
    for shape in shapes:
        base = {"shape": dict(zip(("hidden", "vocab", "layers", "heads", "kv_heads", "intermediate"), SHAPES[shape])),
                "seq_len": args.seq_len, "k": args.k, "torch": torch.__version__,
                "transformers": transformers.__version__, "ceilings": ceiling}
        model_dir = save_random_model(shape, work / "models" / shape, args.device)
        rng = np.random.default_rng(0)
        seqs = [rng.integers(0, SHAPES[shape][1], args.seq_len).astype(np.int32) for _ in range(args.sequences)]
        flops_per_token = model_flops_per_token(shape, args.seq_len)
        plain = plain_pass(model_dir, seqs[:args.plain_sequences], args.k, args.device, args.plain_repeats)
        free_memory(args.device)
        plain_tok_s = args.plain_sequences * args.seq_len / (plain.median_ms / 1e3)
        results.add(f"{shape}/plain", {"tok_s": plain_tok_s, **plain.figures(),
                                       **rates(flops_per_token * plain_tok_s, 1e3, ceiling)},
                    {**base, "sequences": args.plain_sequences, "batch": PLAIN_BATCH})
        for variant in args.variants.split(","):
            figures, config = ours(model_dir, seqs, args.k, work, variant, args.device)
            figures |= {"x_plain": figures["tok_s"] / plain_tok_s, **rates(flops_per_token * figures["tok_s"], 1e3, ceiling),
                        "kernel_check": checks[shape]}
            results.add(f"{shape}/{variant}", figures, {**base, "sequences": args.sequences, **config})
            free_memory(args.device)
        if args.profile:
            profile(results, shape, model_dir, args.seq_len, args.k, args.device, ceiling, base)
            free_memory(args.device)
        shutil.rmtree(model_dir)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
