"""Real data on one GPU: students trained on a real cache (dense SwiGLU against the sparse FFN, a
ReLU gate + L1, at several coefficients; same steps, data, seed and settings), then the FFN
kernels timed on a trained sparse student's own activations and on synthetic inputs with the same
per-row non-zero counts. Every row goes through tests/benchmarks/harness.py.

Part 1 (train, `student.trainer.train`): one row per run (`train/<name>`): held-out KL at the
end, median tokens/s, per-layer sparsity and dead neurons at the end, how many layers the twell
routing put on the kernels. `--kernels dense twell --steps 30 --no-kernel-timing` is the smoke
run of the trainer on both FFN paths.
Part 2 (kernels, CUDA only): for every FFN layer of the sparsest run (or of every sparse run,
`--time-runs all`), its inputs on `--tokens` positions of the cache's own sequences; a row
`<run>/layer<i>/pattern` (non-zeros a token, distinct neurons a token over blocks of 16-128
consecutive tokens, real and synthetic: what the kernels by blocks fetch), then through
bench_twell_ffn_gpu.measure, for the real inputs and for synthetic ones with the same per-row
counts (random columns), the dense gated FFN through cuBLAS and the TwELL path (checked before
timing), forward and forward+backward: rows `<run>/layer<i>/<real|synthetic>/<variant>/<pass>`.
Each layer gets the ELL width a caller would pick from its mean count and a backup that holds
every row over it, so no row takes the fallback path.

    # on the GPU machine, beside a cache and a student folder (config.json suffices):
    PYTHONPATH=. python tests/benchmarks/sparse_ffn_real_gpu.py --cache CACHE --student STUDENT --runs /tmp/sr
    # the student's config reshaped to d 2048, dff 5632, 6 layers, two L1 coefficients, every sparse run:
    ... --shape 2048,5632,6 --l1 5e-4 1e-3 --no-dense-run --time-runs all [--layers 2 3] [--profile]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from pathlib import Path

import torch

from bench_twell_ffn_gpu import ell_width_for, measure, parse_settings, twell_variants
from harness import Results, add_results_arg
from student.data import CacheBatches
from student.model import Student
from student.trainer import TrainConfig, train
from teacher_cache.reader import CacheReader


def train_run(args, name, sparse, l1, kernel):
    """Train one student; returns (figures, config, its final folder)."""
    out = Path(args.runs) / name
    flat = dict(cache=args.cache, student=args.student, out=str(out), steps=args.steps, batch_size=8,
                warmup_steps=max(1, args.steps // 10), heldout=args.heldout, eval_every=max(1, args.steps // 4),
                log_every=max(1, args.steps // 12), save_every=0, seed=0, sparse_ffn=sparse, l1=l1,
                sparse_kernel=kernel)
    if sparse and args.dead_reinit:
        flat.update(dead_reinit=args.dead_reinit, dead_window=args.dead_window)
    config = TrainConfig.from_flat(**flat)
    t0 = time.perf_counter()
    train(config, progress=False)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tr = [r for r in rows if r["kind"] == "train"]
    ev = [r for r in rows if r["kind"] == "eval"]
    fig = {"wall_s": wall, "final_heldout_kl": ev[-1]["kl"], "heldout_kl": [(r["step"], r["kl"]) for r in ev],
           "tok_per_s_median": statistics.median(r["tok_per_s"] for r in tr)}
    if sparse:
        last = tr[-1]
        fig.update({k: last[k] for k in ("ffn_sparsity", "ffn_nnz", "ffn_dead") if k in last})
        fig["mean_sparsity"] = statistics.mean(last["ffn_sparsity"])
        if "ffn_kernel" in last:  # per logging window: (step, layers on the kernels)
            fig["twell_layers_by_step"] = [(r["step"], r["ffn_kernel"].count("twell")) for r in tr]
    return fig, config.to_flat(), out / "student"


def reshaped_student(folder, shape, runs):
    """A copy of the student folder whose config has `shape` = (d_model, d_ff, layers): 64-wide
    heads, 4 query heads per KV head; the tokenizer files are copied as they are."""
    d_model, d_ff, layers = shape
    heads = d_model // 64
    if d_model % 64 or heads % 4:
        raise SystemExit(f"--shape: d_model {d_model} must be a multiple of 256 (64-wide heads, 4 per KV head)")
    out = Path(runs) / f"student_{d_model}x{d_ff}x{layers}"
    shutil.copytree(folder, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config.update(hidden_size=d_model, intermediate_size=d_ff, num_hidden_layers=layers, head_dim=64,
                  num_attention_heads=heads, num_key_value_heads=heads // 4)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return str(out)


def capture_ffn_inputs(folder, cache, tokens, device):
    """Each FFN layer's input [tokens, d] (bf16) on the cache's first sequences, and its weights."""
    model = Student.from_pretrained(folder, dtype=torch.bfloat16, device=device).eval()
    reader = CacheReader(cache)
    length = len(reader.sequence(0).input_ids)
    batches = CacheBatches(reader, list(range(min(reader.num_sequences, math.ceil(tokens / length)))), 16,
                           shuffle=False)
    inputs = [[] for _ in model.layers]
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs[i].append(a[0].reshape(-1, a[0].shape[-1])))
             for i, layer in enumerate(model.layers)]
    with torch.no_grad():
        for batch in batches.epoch_batches():
            model(batch.input_ids.to(device))
    for h in hooks:
        h.remove()
    weights = [(layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight)
               for layer in model.layers]
    return [torch.cat(x)[:tokens].contiguous() for x in inputs], weights


def synthetic_like(x, w_gate, counts, seed=0):
    """Inputs shaped like (x, w_gate) whose rows have `counts` positive gate entries (the real
    layer's), columns from random projections: the last input feature is a per-row threshold and
    w_gate's last column -1."""
    gen = torch.Generator(device=x.device).manual_seed(seed)
    n, d = x.shape
    f = w_gate.shape[0]
    x0 = torch.randn(n, d - 1, device=x.device, generator=gen)
    wg0 = torch.randn(f, d - 1, device=x.device, generator=gen) / math.sqrt(d)
    desc = torch.sort(x0 @ wg0.t(), dim=1, descending=True).values
    padded = torch.cat([desc[:, :1] + 1.0, desc, desc[:, -1:] - 1.0], dim=1)
    thr = 0.5 * (padded.gather(1, counts[:, None]) + padded.gather(1, counts[:, None] + 1))
    return torch.cat([x0, thr], dim=1).to(x.dtype), torch.cat([wg0, -torch.ones(f, 1, device=x.device)], dim=1).to(x.dtype)


def union_per_token(pos_NF, blocks=(16, 32, 64, 128)):
    """Mean distinct active columns per token over blocks of b consecutive rows of the boolean
    gate pattern, for each b (b = 1 would be the mean non-zeros per token)."""
    n = pos_NF.shape[0]
    return {b: (pos_NF[:n - n % b].view(-1, b, pos_NF.shape[1]).any(dim=1).sum(dim=1).float().mean() / b).item()
            for b in blocks}


def time_layer(results, case, x, w_gate, w_up, w_down, counts, variants, args, layer_config):
    """The dense peer and the TwELL variants on one layer's inputs: a row per (variant, pass)."""
    d_ff = w_gate.shape[0]
    width = ell_width_for(1.0 - counts.float().mean().item() / d_ff, d_ff)
    backup = max(-(-x.shape[0] // 8), int((counts > width).sum()))
    params = [t.detach().clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    rows = measure(params, torch.randn_like(x), variants, repeats=args.repeats, profile=args.profile,
                   ell_width=width, backup_rows=backup)
    for (variant, pass_name), figures in rows.items():
        config = {**layer_config, "ell_width": width, "backup_rows": backup,
                  "settings": dict(variants).get(variant)}
        results.add(f"{case}/{variant}/{pass_name}", figures, config)


def time_kernels(results, run_name, folder, args, variants):
    """Part 2 for one trained run: every chosen layer, real inputs and synthetic ones."""
    xs, weights = capture_ffn_inputs(folder, args.cache, args.tokens, "cuda")
    for i, (x, (wg, wu, wd)) in enumerate(zip(xs, weights)):
        if args.layers is not None and i not in args.layers:
            continue
        pos = (x @ wg.t()) > 0
        counts = pos.sum(1)
        density = counts.float().mean().item() / wg.shape[0]
        pattern = {"nnz_mean": counts.float().mean().item(), "nnz_max": int(counts.max()), "density": density,
                   **{f"union_per_token_{b}": u for b, u in union_per_token(pos).items()}}
        del pos
        layer_config = {"run": run_name, "layer": i, "tokens": x.shape[0], "d_model": x.shape[1],
                        "d_ff": wg.shape[0], "dtype": "bf16"}
        if density > args.max_density:
            results.add(f"{run_name}/layer{i}/pattern", {**pattern, "timed": False}, layer_config)
            continue
        xs_syn, wg_syn = (None, None) if args.no_synthetic else synthetic_like(x, wg, counts)
        if xs_syn is not None:
            union = union_per_token((xs_syn @ wg_syn.t()) > 0)
            pattern.update({f"synthetic_union_per_token_{b}": u for b, u in union.items()})
        results.add(f"{run_name}/layer{i}/pattern", {**pattern, "timed": True}, layer_config)
        time_layer(results, f"{run_name}/layer{i}/real", x, wg, wu, wd, counts, variants, args, layer_config)
        if xs_syn is not None:
            time_layer(results, f"{run_name}/layer{i}/synthetic", xs_syn, wg_syn, wu, wd, counts, variants, args,
                       {**layer_config, "inputs": "synthetic, the real layer's per-row counts"})
        del xs_syn, wg_syn
    del xs, weights
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--student", required=True, help="HF folder of the initial student (config.json suffices)")
    ap.add_argument("--shape", default=None, metavar="D_MODEL,D_FF,LAYERS",
                    help="train the student's config reshaped to this (e.g. 2048,5632,6)")
    ap.add_argument("--runs", default="/tmp/sparse_real", help="folder of the training runs")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--l1", type=float, nargs="+", default=[2e-5, 1e-3, 1e-2], help="one sparse run per coefficient")
    ap.add_argument("--kernels", nargs="+", default=["dense"], choices=["dense", "twell"],
                    help="--sparse-kernel of each sparse run (each L1 runs once per kernel)")
    ap.add_argument("--no-dense-run", action="store_true", help="skip the dense SwiGLU run")
    ap.add_argument("--dead-reinit", type=float, default=0.0, help="dead_reinit of the sparse runs (0: the config's off)")
    ap.add_argument("--dead-window", type=int, default=1_000_000, help="dead_window (tokens) with --dead-reinit")
    ap.add_argument("--no-kernel-timing", action="store_true", help="skip part 2")
    ap.add_argument("--time-runs", default="sparsest", choices=["sparsest", "all"],
                    help="part 2 on the sparsest sparse run only, or on every sparse run")
    ap.add_argument("--max-density", type=float, default=0.12,
                    help="part 2 records but does not time layers with more non-zeros than this share")
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="part 2 on these layers only")
    ap.add_argument("--no-synthetic", action="store_true", help="part 2 without the synthetic inputs")
    ap.add_argument("--settings", type=parse_settings, nargs="*", default=[], metavar="JSON",
                    help="part 2 also times the TwELL path with these TwellSettings fields changed")
    ap.add_argument("--profile", action="store_true", help="part 2 adds each kernel's device time")
    ap.add_argument("--tokens", type=int, default=131072, help="positions of cached text for part 2")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls a measurement (median)")
    add_results_arg(ap)
    args = ap.parse_args()
    if args.shape:
        args.student = reshaped_student(args.student, [int(v) for v in args.shape.split(",")], args.runs)
    results = Results(bench="sparse_ffn_real", path=args.results)
    plan = [] if args.no_dense_run else [("dense", False, 0.0, "dense")]
    plan += [(f"l1={c:g}" + ("" if k == "dense" else f",{k}"), True, c, k) for c in args.l1 for k in args.kernels]
    trained = []
    for name, sparse, l1, kernel in plan:
        figures, config, folder = train_run(args, name, sparse, l1, kernel)
        results.add(f"train/{name}", figures, config)
        if sparse:
            trained.append((name, folder, figures["mean_sparsity"]))
    if not trained or args.no_kernel_timing:
        return
    if not torch.cuda.is_available():
        raise SystemExit("part 2 times the kernels on a GPU: no CUDA device here (or pass --no-kernel-timing)")
    timed = trained if args.time_runs == "all" else [max(trained, key=lambda t: t[2])]
    variants = twell_variants(args.settings)
    for name, folder, _ in timed:
        time_kernels(results, name, folder, args, variants)


if __name__ == "__main__":
    main()
