"""Long-context training steps: our chunk-recurrent engine against transformers + Liger, side by side in one run.

Shapes (random init, seeded; one sequence a step, batch 1):
  qwen2-0.5b  bench_train_step_gpu's (hidden 896, 24 layers, 14 / 2 heads, d_ff 4864, vocab 151,936, tied)
  qwen2.5-3b  hidden 2048, 36 layers, 16 query / 2 kv heads, head_dim 128, d_ff 11008, vocab 151,936,
              untied lm-head, qkv bias, rope_theta 1e6
  qwen2.5-7b  hidden 3584, 28 layers, 28 query / 4 kv heads, head_dim 128, d_ff 18944, vocab 152,064,
              untied lm-head, qkv bias, rope_theta 1e6 (OOMB's headline shape)
  tiny        bench_train_step_gpu's tiny shape (CPU smoke test only)
Variants, one after the other in this process, memory freed between, each (length, variant)
with a model and optimizer built afresh; an out-of-memory error becomes a row with "oom": true:
  hf_liger      transformers Qwen2ForCausalLM (sdpa) with Liger's Qwen2 patch (RoPE, RMSNorm,
                SwiGLU, fused linear cross-entropy), gradient checkpointing, bf16 weights, fused
                torch AdamW, loss = model(input_ids, labels=input_ids).loss (ENVIRONMENT.md's recipe)
  ours          student.model.Student with fp32 master weights under bf16 autocast, one micro-batch
                through the trainer's own path (student.step.micro_batch_backward: with
                --chunk-tokens, student.long_context.engine.chunk_recurrent_backward and the fused top-k KL
                normalised over the whole sequence), k = 32 random valid teacher targets in host
                memory (random_batch), the optimizer of student.optim.build_optimizer (--optimizer)
  ours_offload  ours with kv_offload=True: pages and their gradients in pinned host memory
  ours_sparse   ours_offload with --sparse-pages past pages a chunk (OOMB's page top-k; not exact,
                so not checked: its quality is measured by training, not here)
Every variant's step: forward and backward (all chunks), global gradient-norm clipping at 1.0,
optimizer step, zero_grad.

Rows `long_context/<shape>-T<len>/<variant>`: median step seconds over --repeats after --warmup
steps (CUDA events through harness.time_gpu), tokens/s, peak GPU memory (max_memory_allocated
over the timed steps: weights, gradients, optimizer state, activations, resident pages), the
process's resident host memory before the timed steps and its peak over them (host_rss_before_gib,
peak_host_rss_gib: pinned pages and kept attention outputs included; harness.host_peak), and
model TFLOP/s:
  6 x parameters x tokens (every parameter, the input embedding of an untied model included,
  as ENVIRONMENT.md's figures count) + causal attention: per layer, QK^T and PV each 2 FLOP x
  T^2 / 2 x heads x head_dim forward, x3 for forward and backward, i.e. 6 x layers x heads x
  head_dim x T^2 in all. Recomputation (our pass 1, the baseline's checkpointing) is not counted.
and that rate's share of harness.ceilings()' bf16 matmul ceiling.

A first step is not a running job's: kernels compile, and the optimizer creates its states in the
step's update, after the activations' peak, where a later step holds them throughout. When a whole
warm-up step at a long length costs too much, --prime-tokens N runs one untimed step of the same
model and optimizer on N tokens first (compiling, creating the states); what is left of a first
step is then the host allocator's first pinned buffers for that length's pages.

With --num-layers N each shape keeps its first N decoder layers (rows `SHAPE-LN-T...`, plotted
apart): a length whose whole step would outlast a device command's time limit (a 1M-token step of
the 3B shape) is then measured per layer; model TFLOP/s count the layers that ran.

Before the first length of a shape, every requested `ours*` variant is checked against an exact
reference on --check-tokens tokens: the loss and every parameter gradient of the chunked step
(chunks of min(--chunk-tokens, ceil(check_tokens / 3)) tokens, so at least three, generally not
page-aligned) against the same Student's whole-sequence backward in fp32; under bf16 each
gradient may be off by a few times what the whole-sequence bf16 step's is (TOLERANCES). The run
stops if one differs more.

    PYTHONPATH=. python tests/benchmarks/bench_long_context_gpu.py --shape qwen2-0.5b \\
        --lengths 65536,131072 --results $OUT/results.jsonl --plot $OUT/long_context.png

On a CPU, `--device cpu --shape tiny --lengths 256,512 --chunk-tokens 64` runs `ours` (a smoke
test, not a figure). `--plot-only` draws the plot from the rows already in --results.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch
from bench_train_step_gpu import GIB, student_config
from harness import (OUTPUT_DIR, Results, add_results_arg, ceilings, check_close, free_memory, host_peak, load_rows,
                     reset_host_peak, tflops, time_cpu, time_gpu)

from distill.devices import resolve_dtype
from student.config import StudentConfig
from student.data import Batch
from student.model import Student

BENCH = "long_context"
VARIANTS = ("ours", "ours_offload", "ours_sparse", "hf_liger")
OFFLOADED = ("ours_offload", "ours_sparse")
TOP_K = 32  # cached teacher targets a position (random, valid)
# (loss relative error, per-parameter relative gradient-norm error) the check allows against the
# exact fp32 whole-sequence step: fp32 chunking is exact up to summation order. Under bf16 the
# gradient bound is BF16_SLACK x the whole-sequence bf16 step's own error, this value its floor:
# the noise of bf16 differs by parameter (key biases' gradients are the noisiest), so a fixed
# bound would be either loose for most parameters or too tight for some.
TOLERANCES = {"float32": (1e-5, 1e-4), "bfloat16": (5e-3, 1e-2)}
BF16_SLACK = 3.0


def shape_config(shape: str, max_len: int) -> StudentConfig:
    if shape == "qwen2.5-3b":
        config = student_config("qwen2-0.5b").replace(hidden_size=2048, intermediate_size=11008, num_layers=36,
                                                      num_heads=16, num_kv_heads=2, head_dim=128,
                                                      tie_word_embeddings=False)
    elif shape == "qwen2.5-7b":
        config = student_config("qwen2-0.5b").replace(hidden_size=3584, intermediate_size=18944, num_layers=28,
                                                      num_heads=28, num_kv_heads=4, head_dim=128, vocab_size=152_064,
                                                      tie_word_embeddings=False)
    else:
        config = student_config(shape)
    return config.replace(max_position_embeddings=max(max_len, config.max_position_embeddings))


def random_batch(length: int, vocab: int, device, seed: int) -> Batch:
    """One sequence of `length` random ids with valid cached targets: per position TOP_K distinct
    ids and descending log-probs holding 90% of the mass, the rest as tail; the next id as target.
    Drawn on `device` (fast) and handed over in host memory, page-locked on CUDA, as the trainer's
    loader hands its batches over: the step copies each chunk's rows to the GPU as it needs them,
    so a GPU peak holds no whole-sequence targets (k = 32 of them are 409 bytes a token)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(3, vocab, (1, length), device=device, generator=gen)
    offsets_K = torch.randperm(vocab, device=device, generator=gen)[:TOP_K]
    base_N = torch.randint(0, vocab, (length,), device=device, generator=gen)
    topk_ids = (base_N[:, None] + offsets_K[None]) % vocab  # distinct within a row
    logits_NK = (torch.randn(length, TOP_K, device=device, generator=gen) * 2.0).sort(dim=1, descending=True).values
    logprobs_NK = logits_NK - logits_NK.logsumexp(dim=1, keepdim=True) + math.log(0.9)
    target_ids = torch.cat([ids[0, 1:], ids.new_full((1,), -1)])
    target_logprob = torch.full((length,), -6.0, device=device)
    target_logprob[-1] = float("nan")
    batch = Batch(ids, topk_ids, logprobs_NK, torch.full((length,), math.log(0.1), device=device), target_ids,
                  target_logprob, torch.ones(length, dtype=torch.bool, device=device)).to("cpu")
    return batch.pin_memory() if torch.device(device).type == "cuda" else batch


def train_config(args, device: str, dtype: str, *, chunk_tokens: int | None, kv_offload: bool = False,
                 sparse_pages: int | None = None):
    """The TrainConfig the trainer's micro-batch path reads (loss, dtype, device, long context,
    optimizer); its paths are never opened."""
    from student.trainer import TrainConfig

    return TrainConfig.from_flat(cache="unused", out="unused", student="unused", device=device, dtype=dtype,
                                 optimizer=args.optimizer, clip_grad=1.0, chunk_tokens=chunk_tokens,
                                 page_tokens=args.page_tokens, kv_offload=kv_offload,
                                 offload_pages=args.offload_pages, sparse_pages=sparse_pages,
                                 keep_attention_chunks=args.keep_attention_chunks)


def build_ours(config: StudentConfig, device: str, seed: int) -> Student:
    torch.manual_seed(seed)
    with torch.device(device):  # random init on the device: seconds instead of minutes on the host
        return Student(config).train()


def ours_backward(model, batch, config) -> torch.Tensor:
    """The trainer's forward and backward of one micro-batch; its loss, detached."""
    from student.step import micro_batch_backward

    amp_dtype = torch.bfloat16 if config.dtype == "bfloat16" else None
    loss, _ = micro_batch_backward(model, batch, config, amp_dtype, cache_temperature=1.0)
    return loss


def ours_step_fn(model, batch, config):
    """One training step on `batch`, or on the batch it is given (a priming step's)."""
    from student.optim.build import build_optimizer
    from student.optim.clip import clip_grad_norm_foreach

    optimizer = build_optimizer(model, config.optim, config.device)

    def step(batch=batch):
        ours_backward(model, batch, config)
        clip_grad_norm_foreach(model.parameters(), config.optim.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def hf_liger_step_fn(config: StudentConfig, length: int, device: str, seed: int):
    """One training step on `length` random ids, or on the first `prime_tokens` of them."""
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    hf_config = Qwen2Config(**config.to_hf_dict("bfloat16"))
    hf_config._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen2ForCausalLM(hf_config).to(torch.bfloat16)
    apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=model)
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(3, config.vocab_size, (1, length), device=device, generator=gen)

    def step(prime_tokens: int | None = None):
        x = ids[:, :prime_tokens]
        model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def check_exact(variant: str, config: StudentConfig, args, device: str, dtype: str) -> dict:
    """The chunked step's loss and parameter gradients against the same Student's exact
    whole-sequence step in fp32 (module docstring); raises AssertionError past TOLERANCES[dtype].
    Under bf16 a gradient may differ from the exact one by BF16_SLACK x what the whole-sequence
    bf16 step's does (at least the floor): chunking may round differently, not worse in kind."""
    n = args.check_tokens
    chunk = min(args.chunk_tokens, -(-n // 3))
    model = build_ours(config, device, args.seed)
    batch = random_batch(n, config.vocab_size, device, args.seed + 1)
    runs = [(None, "float32"), (chunk, dtype)] + ([(None, dtype)] if dtype != "float32" else [])
    results = []
    for chunk_tokens, run_dtype in runs:
        offload = chunk_tokens is not None and variant == "ours_offload"
        loss = ours_backward(model, batch, train_config(args, device, run_dtype, chunk_tokens=chunk_tokens,
                                                        kv_offload=offload))
        results.append((loss.float(), {name: p.grad.float().clone() for name, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (ref_loss, ref_grads), (loss, grads) = results[:2]
    loss_tol, grad_tol = TOLERANCES[dtype]
    loss_err = check_close(f"{variant} check: loss of {n} tokens in chunks of {chunk}", loss, ref_loss,
                           atol=0.0, rtol=loss_tol)
    errors = _relative_errors(grads, ref_grads)
    allowed = {name: grad_tol for name in errors}
    if len(results) == 3:
        allowed = {name: BF16_SLACK * max(e, grad_tol) for name, e in _relative_errors(results[2][1], ref_grads).items()}
    worst = max(errors, key=lambda name: errors[name] / allowed[name])
    check_close(f"{variant} check: relative gradient-norm error of {worst} (in chunks of {chunk}, {dtype})",
                errors[worst], 0.0, atol=allowed[worst])
    del model, results, grads, ref_grads
    free_memory(device)
    return {"check_tokens": n, "check_chunk_tokens": chunk, "check_loss_error": loss_err,
            "check_grad_error": errors[worst], "check_grad_allowed": allowed[worst], "check_grad_error_param": worst}


def _relative_errors(grads: dict, ref_grads: dict) -> dict:
    return {name: ((grads[name] - g).norm() / g.norm().clamp_min(1e-30)).item() for name, g in ref_grads.items()}


def param_count(config: StudentConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Student(config).parameters())


def model_flops(config: StudentConfig, params: int, tokens: int) -> float:
    attention = 6 * config.num_layers * config.num_heads * config.head_dim * tokens**2
    return 6 * params * tokens + attention


def measure(variant: str, config: StudentConfig, length: int, args, device: str, dtype: str) -> dict:
    """Figures of one (length, variant): timings, memory, rates; {"oom": True, ...} when it did not fit."""
    step = None
    prime = min(args.prime_tokens, length)
    try:
        if variant == "hf_liger":
            step = hf_liger_step_fn(config, length, device, args.seed)
            if prime:
                step(prime)
        else:
            model = build_ours(config, device, args.seed)
            batch = random_batch(length, config.vocab_size, device, args.seed + 1)
            step = ours_step_fn(model, batch, train_config(
                args, device, dtype, chunk_tokens=args.chunk_tokens, kv_offload=variant in OFFLOADED,
                sparse_pages=args.sparse_pages if variant == "ours_sparse" else None))
            if prime:
                step(random_batch(prime, config.vocab_size, device, args.seed + 2))
            del model, batch
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        host_before = reset_host_peak()
        if device == "cuda":
            timing = time_gpu(step, warmup=args.warmup, repeats=args.repeats)
        else:
            timing = time_cpu(step, warmup=args.warmup, repeats=args.repeats)
        host_peak_bytes = host_peak()
    except torch.OutOfMemoryError as error:
        return {"oom": True, "peak_gib_at_oom": torch.cuda.max_memory_allocated() / GIB,
                "error": str(error).splitlines()[0]}
    finally:
        del step
    seconds = timing.median_ms / 1e3
    figures = {"oom": False, "step_s": seconds, "min_step_s": timing.min_ms / 1e3, "repeats": len(timing.times_ms),
               "tok_s": length / seconds}
    if host_before is not None:
        figures.update(host_rss_before_gib=host_before / GIB, peak_host_rss_gib=host_peak_bytes / GIB)
    if device == "cuda":
        figures["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    figures["model_tflops"] = tflops(model_flops(config, param_count(config), length), timing.median_ms)
    if device == "cuda":
        figures["of_matmul_ceiling"] = figures["model_tflops"] / ceilings()["matmul_bf16_tflops"]
    return figures


def plot(rows: list[dict], path: Path) -> None:
    """Peak GPU memory and tokens/s against length: a row of two panels per shape, one line per
    variant (and chunk size); OOM rows left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes: dict[str, dict[str, list]] = {}
    for row in rows:
        if not row["figures"].get("oom"):
            chunk = row["config"].get("chunk_tokens")
            label = row["config"]["variant"] + (f" (chunks of {chunk})" if chunk else "")
            layers = row["config"].get("num_layers")
            shape = row["config"]["shape"] + (f" ({layers} layers)" if layers else "")
            shapes.setdefault(shape, {}).setdefault(label, []).append(row)
    fig, axes = plt.subplots(max(len(shapes), 1), 2, figsize=(11, 3.8 * max(len(shapes), 1)), squeeze=False)
    for (shape, lines), (mem, speed) in zip(sorted(shapes.items()), axes):
        for label, line in sorted(lines.items()):
            line.sort(key=lambda r: r["config"]["length"])
            lengths = [r["config"]["length"] for r in line]
            mem.plot(lengths, [r["figures"].get("peak_gib", 0.0) for r in line], marker="o", label=label)
            speed.plot(lengths, [r["figures"]["tok_s"] for r in line], marker="o", label=label)
        for ax, title in ((mem, "peak GPU memory (GiB)"), (speed, "tokens / s")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length (tokens)")
            ax.set_title(f"{shape}: {title}")
            ax.grid(True, alpha=0.3)
        speed.legend(fontsize=8)
    commits = sorted({row["commit"] for row in rows})
    fig.suptitle(f"one training step, batch 1, {_warmth(rows)} ({rows[0]['device'] if rows else ''}; "
                 f"commit {', '.join(commits)})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=85)  # the README carries it in every clone: under test_readme's size limit
    print(f"plot: {path}", flush=True)


def _warmth(rows: list[dict]) -> str:
    """What preceded the rows' timed steps, from their configs (or, for rows older than those
    fields, the commands' flags, whose defaults were warm-up 1 and no priming)."""
    def flag(row, name: str, default: int) -> int:
        if name.replace("-", "_") in row["config"]:
            return row["config"][name.replace("-", "_")]
        found = re.search(rf"--{name}[ =](\d+)", row.get("command", ""))
        return int(found.group(1)) if found else default

    kinds = {(flag(row, "warmup", 1), flag(row, "prime-tokens", 0)) for row in rows}
    if len(kinds) != 1:
        return "warm-up differs between rows"
    ((warmup, prime),) = kinds
    text = f"after {warmup} warm-up step{'s' * (warmup != 1)}" if warmup else "the first step (no warm-up)"
    return text + (f", primed on {prime} tokens" if prime else "")


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<40} {'step s':>9} {'tok/s':>9} {'peak GiB':>9} {'host GiB':>9} {'TFLOP/s':>8} {'ceiling':>8}")
    for row in rows:
        f = row["figures"]
        if f.get("oom"):
            print(f"{row['case']:<40} {'out of memory':>29}")
            continue
        cells = [f.get(key) for key in ("step_s", "tok_s", "peak_gib", "peak_host_rss_gib", "model_tflops",
                                        "of_matmul_ceiling")]
        text = ["-" if v is None else f"{v:.1%}" if key == 5 else f"{v:.4g}" for key, v in enumerate(cells)]
        print(f"{row['case']:<40} {text[0]:>9} {text[1]:>9} {text[2]:>9} {text[3]:>9} {text[4]:>8} {text[5]:>8}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2-0.5b", help="comma-separated, of qwen2-0.5b, qwen2.5-3b, qwen2.5-7b, tiny")
    parser.add_argument("--lengths", default="65536,131072", help="comma-separated sequence lengths (tokens a step)")
    parser.add_argument("--variants", default="ours,hf_liger", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--chunk-tokens", type=int, default=16384, help="tokens per chunk of the chunk-recurrent step")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="keep only this many of each shape's decoder layers (rows `SHAPE-LN-T...`): its rates "
                             "per layer at a length whose whole step would outlast a command's time limit")
    parser.add_argument("--page-tokens", type=int, default=64, help="positions per page of the key/value store")
    parser.add_argument("--offload-pages", type=int, default=1024,
                        help="pages brought to the GPU at once by ours_offload (LongContextConfig.offload_pages)")
    parser.add_argument("--sparse-pages", type=int, default=128,
                        help="past pages a chunk attends in ours_sparse (LongContextConfig.sparse_pages)")
    parser.add_argument("--keep-attention-chunks", type=int, default=None,
                        help="ours variants: pass 1 keeps the attention outputs of only the last N chunks "
                             "(LongContextConfig.keep_attention_chunks; default every chunk's): a host that cannot "
                             "hold a million tokens' (7 KB a token a layer for the 7B shape) attends again")
    parser.add_argument("--optimizer", default="adamw8bit", choices=("adamw8bit", "adamw", "foam"),
                        help="optimizer of the ours variants (student.optim.build_optimizer)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    parser.add_argument("--prime-tokens", type=int, default=0,
                        help="one untimed step of this many tokens before the warm-up and timed steps (0: none)")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps; the row gives their median")
    parser.add_argument("--check-tokens", type=int, default=2048, help="length of the exactness check (0: none)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="autocast dtype of the ours variants (auto: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=None, nargs="?", const=OUTPUT_DIR / "long_context.png",
                        help=f"write a PNG of this run's rows (default path {OUTPUT_DIR / 'long_context.png'})")
    parser.add_argument("--plot-commits", type=lambda text: text.split(","), default=None,
                        help="with --plot-only: only rows of these commits (comma-separated), e.g. the current code's")
    parser.add_argument("--plot-only", action="store_true",
                        help="run nothing: plot the long_context rows already in --results (the newest per case)")
    add_results_arg(parser)
    args = parser.parse_args(argv)
    shapes, variants = args.shape.split(","), args.variants.split(",")
    if unknown := set(shapes) - {"qwen2-0.5b", "qwen2.5-3b", "tiny"}:
        parser.error(f"--shape: unknown {sorted(unknown)}; choose from qwen2-0.5b, qwen2.5-3b, tiny")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if min(lengths) < 2:
        parser.error(f"--lengths must be at least 2 tokens each, got {args.lengths!r}")
    if args.chunk_tokens < 1:
        parser.error(f"--chunk-tokens must be >= 1, got {args.chunk_tokens}")
    if args.num_layers is not None and args.num_layers < 1:
        parser.error(f"--num-layers must be >= 1, got {args.num_layers}")
    if args.check_tokens and args.check_tokens < 3:
        parser.error(f"--check-tokens must be 0 (no check) or >= 3, got {args.check_tokens}")
    if args.device == "cpu":
        for skipped in ("hf_liger", *OFFLOADED):
            if skipped in variants:
                print(f"{skipped} skipped on the CPU (it needs CUDA)", flush=True)
                variants.remove(skipped)
    variants.sort(key=lambda v: v == "hf_liger")  # Liger's patches are module-wide: its rows last
    args.shapes, args.variants, args.lengths = shapes, variants, lengths
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.plot_only:
        newest = {(row["case"], row["config"].get("chunk_tokens")): row for row in load_rows(args.results)
                  if row["bench"] == BENCH and (not args.plot_commits or row["commit"] in args.plot_commits)}
        plot(list(newest.values()), args.plot or OUTPUT_DIR / "long_context.png")
        return []
    device = args.device
    dtype = resolve_dtype(args.dtype, device)
    results = Results(bench=BENCH, path=args.results)
    ceiling = ceilings() if device == "cuda" else None
    import transformers

    for shape in args.shapes:
        config = shape_config(shape, max(args.lengths))
        name = shape
        if args.num_layers is not None:
            config, name = config.replace(num_layers=args.num_layers), f"{shape}-L{args.num_layers}"
        checks = {}
        if args.check_tokens:
            for variant in args.variants:
                if variant.startswith("ours") and variant != "ours_sparse":
                    checks[variant] = check_exact(variant, config, args, device, dtype)
                    print(f"{name} {variant}: exact against the whole-sequence step ({checks[variant]})", flush=True)
        for variant in args.variants:
            for length in args.lengths:
                figures = {**measure(variant, config, length, args, device, dtype), **checks.get(variant, {})}
                free_memory(device)
                row_config = {"shape": shape, "num_layers": args.num_layers, "variant": variant, "length": length,
                              "batch_size": 1,
                              "warmup": args.warmup, "prime_tokens": args.prime_tokens,
                              "student": {**vars(config), "parameters": param_count(config)}, "ceilings": ceiling,
                              "torch": torch.__version__, "transformers": transformers.__version__}
                if variant.startswith("ours"):
                    row_config.update(dtype=dtype, optimizer=args.optimizer, chunk_tokens=args.chunk_tokens,
                                      page_tokens=args.page_tokens, kv_offload=variant in OFFLOADED,
                                      offload_pages=args.offload_pages, top_k=TOP_K,
                                      sparse_pages=args.sparse_pages if variant == "ours_sparse" else None,
                                      keep_attention_chunks=args.keep_attention_chunks)
                results.add(f"{name}-T{length}/{variant}", figures, row_config)
    print_table(results.rows)
    if args.plot:
        plot(results.rows, args.plot)
    return results.rows


if __name__ == "__main__":
    main()
