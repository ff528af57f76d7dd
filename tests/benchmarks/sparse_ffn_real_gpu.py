"""Real data on one GPU: a student trained on a real cache, dense SwiGLU against the sparse FFN
(ReLU gate + L1) at several coefficients, same steps, data, seed and settings; then the FFN kernels
on the trained sparse student's own activations (real trained activations) and on synthetic
inputs with the same per-row non-zero counts.

Part 1 (train): per run, held-out KL through training, per-layer sparsity, dead neurons and
non-zeros per token at the end, throughput. Part 2 (kernels, CUDA only): for every FFN layer of
the sparsest run (or of every sparse run, --time-runs all), its inputs on `--tokens` positions of
cached text (the cache's own sequences, as the student sees them), timed through
kernels/twell_ffn.py's Triton path against the dense gated FFN through cuBLAS (forward and
forward+backward, CUDA events, medians), and the Triton path again on synthetic inputs whose rows
have the same non-zero counts (lognormal-free: the real counts). Each layer gets the ELL width a
caller would pick from its mean count (bench_twell_ffn_gpu.ell_width_for) and a backup that holds
every row over it, so no row takes the fallback path. Per layer, also how many distinct neurons
fire in blocks of 16 / 32 / 64 / 128 consecutive tokens, real against synthetic: the rows a
kernel that shared weight rows across a block of tokens would still fetch, per token.

    # on the GPU machine, from a clean copy of HEAD beside the cache and student folders of
    # bench_optimizer_convergence_gpu.py:
    PYTHONPATH=$PWD python3 tests/benchmarks/sparse_ffn_real_gpu.py --cache ../stdlib512 \\
        --student ../student135m --runs /tmp/sparse_real --out $OUT/sparse_real.json
    # the same student config reshaped to the issue's FFN (d 2048, d_ff 5632), 6 layers:
    ... --shape 2048,5632,6 --l1 3e-3 1e-2 3e-2 --time-runs all
    # two layers only, real inputs only, with each kernel's device time:
    ... --shape 2048,5632,6 --l1 5e-4 --no-dense-run --time-runs all --layers 2 3 --no-synthetic --profile
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import shutil
import time
from pathlib import Path

import torch

import kernels.twell_ffn as twell
from kernels.twell_ffn import relu_gated_ffn
from student.data import CacheBatches
from student.model import Student
from student.trainer import TrainConfig, train
from teacher_cache.reader import CacheReader


def train_run(args, name, sparse, l1, kernel="dense"):
    out = Path(args.runs) / name
    cfg = TrainConfig(cache=args.cache, student=args.student, out=str(out), steps=args.steps, batch_size=8,
                      warmup_steps=max(1, args.steps // 10), heldout=args.heldout, eval_every=max(1, args.steps // 4),
                      log_every=max(1, args.steps // 12), save_every=0, sparse_ffn=sparse, l1=l1, seed=0,
                      sparse_kernel=kernel, dead_reinit=args.dead_reinit if sparse else 0.0,
                      dead_window=args.dead_window)
    t0 = time.perf_counter()
    train(cfg, progress=False)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tr = [r for r in rows if r["kind"] == "train"]
    ev = [r for r in rows if r["kind"] == "eval"]
    rec = {"name": name, "sparse_ffn": sparse, "l1": l1, "sparse_kernel": kernel, "wall_s": wall,
           "heldout_kl": [(r["step"], r["kl"]) for r in ev], "final_heldout_kl": ev[-1]["kl"],
           "tok_per_s_median": sorted(r["tok_per_s"] for r in tr)[len(tr) // 2]}
    if sparse:
        last = tr[-1]
        rec.update({k: last[k] for k in ("ffn_sparsity", "ffn_nnz", "ffn_dead", "ffn_kernel") if k in last})
        if "ffn_kernel" in last:  # the routing of each logging window: (step, layers on the kernels)
            rec["twell_layers_by_step"] = [(r["step"], r["ffn_kernel"].count("twell")) for r in tr]
        rec["mean_dead"] = sum(last["ffn_dead"]) / len(last["ffn_dead"])
        rec["reinit_rows_total"] = sum(sum(r.get("ffn_reinit", [0])) for r in tr)
        # throughput after the first routing (logging) step, where twell layers start to run
        late = [r["tok_per_s"] for r in tr if r["step"] > cfg.log_every]
        rec["tok_per_s_median_after_first_log"] = sorted(late)[len(late) // 2] if late else None
        rec["mean_sparsity"] = sum(last["ffn_sparsity"]) / len(last["ffn_sparsity"])
    return rec, out / "student"


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
    xs = torch.cat([x0, thr], dim=1).to(x.dtype)
    wgs = torch.cat([wg0, -torch.ones(f, 1, device=x.device)], dim=1).to(x.dtype)
    return xs, wgs


@contextlib.contextmanager
def kernel_settings(**values):
    """kernels/twell_ffn.py's module settings set to `values` inside the block, restored after."""
    saved = {key: getattr(twell, key) for key in values}
    for key, value in values.items():
        setattr(twell, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(twell, key, value)


def union_per_token(pos_NF, blocks=(16, 32, 64, 128)):
    """Mean distinct active columns per token over blocks of b consecutive rows of the boolean
    gate pattern, for each b (b = 1 would be the mean non-zeros per token)."""
    n = pos_NF.shape[0]
    return {b: (pos_NF[:n - n % b].view(-1, b, pos_NF.shape[1]).any(dim=1).sum(dim=1).float().mean() / b).item()
            for b in blocks}


def time_layer(x, w_gate, w_up, w_down, rep_ms, counts, one_wide_row=False, blocks_settings=(), profile=False):
    """Forward and forward+backward (medians, ms) of the dense gated FFN through cuBLAS (the
    issue's peer, no L1 term) and of the Triton path, with the ELL width a caller would pick for
    these counts and a backup for every row over it; with one_wide_row, the Triton path again
    with the wide launches for the longest list only (as before they existed); for each dict of
    blocks_settings, the Triton path by blocks again with those kernels/twell_ffn.py settings; with
    profile, device time per kernel (torch.profiler) of dense, of the default path and of those
    settings, forward and forward+backward."""
    import triton
    from bench_twell_ffn_gpu import breakdown, dense_ffn, ell_width_for

    d_ff = w_gate.shape[0]
    width = ell_width_for(1.0 - counts.float().mean().item() / d_ff, d_ff)
    backup = max(-(-x.shape[0] // 8), int((counts > width).sum()))
    kw = {"impl": "triton", "ell_width": width, "backup_rows": backup}

    params = [t.detach().clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    grad_y = torch.randn_like(x)
    grad_l1 = torch.tensor(2e-5, device=x.device)

    def sparse():
        return relu_gated_ffn(*params, **kw)[:2]

    # forward and backward by the gather kernels; the forward by blocks of tokens with the gather
    # backward; both by blocks (_UNION_FORWARD, _UNION_BACKWARD), whichever the default is
    variants = {"dense": (lambda: (dense_ffn(*params),), (grad_y,)), "triton_gather": (sparse, (grad_y, grad_l1)),
                "triton_blocks_fwd": (sparse, (grad_y, grad_l1)), "triton_blocks": (sparse, (grad_y, grad_l1))}
    if one_wide_row:
        variants["triton_one_wide_row"] = (sparse, (grad_y, grad_l1))
    ways = {"triton_gather": (False, False), "triton_blocks_fwd": (True, False), "triton_blocks": (True, True)}
    settings = {"dense": {}, "triton_one_wide_row": {"_WIDE_ROWS_DIV": 1 << 40}}
    settings.update({name: {"_UNION_FORWARD": f, "_UNION_BACKWARD": b} for name, (f, b) in ways.items()})
    for i, values in enumerate(blocks_settings):
        variants[f"triton_blocks_v{i}"] = (sparse, (grad_y, grad_l1))
        settings[f"triton_blocks_v{i}"] = {"_UNION_FORWARD": True, "_UNION_BACKWARD": True, **values}
    out = {}
    for name, (fwd, grads) in variants.items():
        with kernel_settings(**settings[name]):
            out[f"{name}_fwd_ms"] = triton.testing.do_bench(fwd, warmup=10, rep=rep_ms, grad_to_none=params,
                                                            return_mode="median")
            out[f"{name}_fwd_bwd_ms"] = triton.testing.do_bench(
                lambda: torch.autograd.backward(fwd(), grads), warmup=10, rep=rep_ms, grad_to_none=params,
                return_mode="median")
            if profile and (name in ("dense", "triton_blocks") or name.startswith("triton_blocks_v")):
                out[f"{name}_fwd_profile"] = breakdown(fwd)
                out[f"{name}_fwd_bwd_profile"] = breakdown(lambda: torch.autograd.backward(fwd(), grads))
                for p in params:
                    p.grad = None

    # y and the four gradients against the torch path, relative errors
    def outputs(**kwargs):
        ps = [t.detach().clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
        y, l1, stats = relu_gated_ffn(*ps, **kwargs)
        torch.autograd.backward((y, l1), (grad_y, grad_l1))
        return [y.detach()] + [p.grad for p in ps], stats

    ref, _ = outputs(impl="torch")
    for suffix, name in (("", "triton_gather"), ("_blocks", "triton_blocks")):
        with kernel_settings(**settings[name]):
            got, stats = outputs(**kw)
        for what, a, b in zip(("y", "dx", "dwg", "dwu", "dwd"), got, ref):
            err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)
            out[f"rel_err_{what}{suffix}"] = err.item()
        del got
    del ref
    out["nnz_mean"] = float(stats.nnz)
    out["ell_width"], out["backup_rows"] = width, backup
    out["overflow_rows"] = int(stats.overflow_rows)
    out["fallback_rows"] = int(stats.fallback_rows)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--student", required=True, help="HF folder of the initial student (config.json suffices)")
    ap.add_argument("--shape", default=None, metavar="D_MODEL,D_FF,LAYERS",
                    help="train the student's config reshaped to this (e.g. the issue's 2048,5632,6)")
    ap.add_argument("--runs", default="/tmp/sparse_real")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--l1", type=float, nargs="+", default=[2e-5, 1e-3, 1e-2])
    ap.add_argument("--kernels", nargs="+", default=["dense"], choices=["dense", "twell"],
                    help="--sparse-kernel of each sparse run (each L1 runs once per kernel)")
    ap.add_argument("--no-dense-run", action="store_true", help="skip the dense SwiGLU run")
    ap.add_argument("--dead-reinit", type=float, default=0.0, help="dead_reinit of the sparse runs (App. C.3: 0.1)")
    ap.add_argument("--dead-window", type=int, default=1_000_000, help="dead_window (tokens) with --dead-reinit")
    ap.add_argument("--no-kernel-timing", action="store_true", help="skip part 2")
    ap.add_argument("--time-runs", default="sparsest", choices=["sparsest", "all"],
                    help="part 2 on the sparsest sparse run only, or on every sparse run")
    ap.add_argument("--max-density", type=float, default=0.12,
                    help="part 2 skips layers with more non-zeros than this share (the sparse path at 90%% "
                         "sparsity already takes 5x dense's time)")
    ap.add_argument("--blocks-settings", nargs="+", type=json.loads, default=[], metavar="JSON",
                    help="time the real (and synthetic) inputs by blocks again with these kernels/twell_ffn.py "
                         """settings each, e.g. '{"_UNION_BM": 32}' (lists for tuples)""")
    ap.add_argument("--one-wide-row", action="store_true",
                    help="part 2 also times the real inputs with only the longest list in the wide launches")
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="part 2 on these layers only")
    ap.add_argument("--no-synthetic", action="store_true", help="part 2 without the synthetic inputs")
    ap.add_argument("--profile", action="store_true",
                    help="part 2 also gives each kernel's device time (torch.profiler), dense and by blocks")
    ap.add_argument("--tokens", type=int, default=131072, help="positions of cached text for the kernel timing")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.shape:
        args.student = reshaped_student(args.student, [int(v) for v in args.shape.split(",")], args.runs)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "args": vars(args), "runs": []}

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    folders = {}
    plan = [] if args.no_dense_run else [("dense", False, 0.0, "dense")]
    plan += [(f"l1={c:g}" + ("" if k == "dense" else f",{k}"), True, c, k) for c in args.l1 for k in args.kernels]
    for name, sparse, l1, kernel in plan:
        rec, folders[name] = train_run(args, name, sparse, l1, kernel)
        result["runs"].append(rec)
        print(json.dumps({k: v for k, v in rec.items() if not k.startswith("ffn_")}), flush=True)
        save()
    sparse_runs = [r for r in result["runs"] if r["sparse_ffn"]]
    if not sparse_runs or device != "cuda" or args.no_kernel_timing:
        return
    timed = sparse_runs if args.time_runs == "all" else [max(sparse_runs, key=lambda r: r["mean_sparsity"])]
    result["kernels"] = []
    for run in timed:
        xs, weights = capture_ffn_inputs(folders[run["name"]], args.cache, args.tokens, device)
        entry = {"run": run["name"], "tokens": xs[0].shape[0], "layers": []}
        result["kernels"].append(entry)
        blocks_settings = [{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
                           for d in args.blocks_settings]
        for i, (x, (wg, wu, wd)) in enumerate(zip(xs, weights)):
            if args.layers is not None and i not in args.layers:
                continue
            pos = (x @ wg.t()) > 0
            counts = pos.sum(1)
            density = counts.float().mean().item() / wg.shape[0]
            union = union_per_token(pos)
            del pos
            if density > args.max_density:
                entry["layers"].append({"layer": i, "skipped_density": density, "union_per_token": union})
                print(f"{run['name']} layer {i:2d}: density {density:.3f} > --max-density, not timed", flush=True)
                continue
            rec = {"layer": i, "nnz_max": int(counts.max()), "union_per_token": union,
                   "real": time_layer(x, wg, wu, wd, args.rep_ms, counts, one_wide_row=args.one_wide_row,
                                      blocks_settings=blocks_settings, profile=args.profile)}
            if not args.no_synthetic:
                xs_syn, wg_syn = synthetic_like(x, wg, counts)
                rec["synthetic_union_per_token"] = union_per_token((xs_syn @ wg_syn.t()) > 0)
                rec["synthetic_same_counts"] = time_layer(xs_syn, wg_syn, wu, wd, args.rep_ms, counts,
                                                          blocks_settings=blocks_settings, profile=args.profile)
            entry["layers"].append(rec)
            r = rec["real"]
            s = rec.get("synthetic_same_counts", {k: math.nan for k in r})
            syn_union = rec.get("synthetic_union_per_token", {b: math.nan for b in union})
            wide = (f" | one wide row fwd {r['triton_one_wide_row_fwd_ms']:.2f} "
                    f"f+b {r['triton_one_wide_row_fwd_bwd_ms']:.2f}" if args.one_wide_row else "")
            for v, values in enumerate(args.blocks_settings):  # (i is the layer)
                wide += (f" | {values} fwd {r[f'triton_blocks_v{v}_fwd_ms']:.2f} "
                         f"f+b {r[f'triton_blocks_v{v}_fwd_bwd_ms']:.2f} (synthetic "
                         f"{s[f'triton_blocks_v{v}_fwd_ms']:.2f} {s[f'triton_blocks_v{v}_fwd_bwd_ms']:.2f})")
            unions = " ".join(f"{b}:{u:.1f}/{syn_union[b]:.1f}" for b, u in union.items())
            print(f"{run['name']} layer {i:2d} nnz {r['nnz_mean']:6.1f} (max {rec['nnz_max']:4d}, W {r['ell_width']}, "
                  f"{r['overflow_rows']} rows > W, {r['fallback_rows']} fallback): dense fwd {r['dense_fwd_ms']:.2f} "
                  f"f+b {r['dense_fwd_bwd_ms']:.2f} | twell fwd / f+b: gathers {r['triton_gather_fwd_ms']:.2f} "
                  f"{r['triton_gather_fwd_bwd_ms']:.2f}, blocks fwd only {r['triton_blocks_fwd_fwd_bwd_ms']:.2f}, "
                  f"blocks {r['triton_blocks_fwd_ms']:.2f} {r['triton_blocks_fwd_bwd_ms']:.2f}{wide} | synthetic: "
                  f"gathers {s['triton_gather_fwd_ms']:.2f} {s['triton_gather_fwd_bwd_ms']:.2f}, blocks fwd only "
                  f"{s['triton_blocks_fwd_fwd_bwd_ms']:.2f}, blocks {s['triton_blocks_fwd_ms']:.2f} "
                  f"{s['triton_blocks_fwd_bwd_ms']:.2f} | distinct neurons per token in blocks, real/synthetic "
                  f"{unions} | dx err blocks {r['rel_err_dx_blocks']:.1e} gathers {r['rel_err_dx']:.1e}", flush=True)
            if args.profile:
                for key in [k for k in r if k.endswith("_profile")]:
                    print(f"  real {key}: {json.dumps({k: v for k, v in r[key].items() if k != 'other_top'})}",
                          flush=True)
            save()
        del xs, weights


if __name__ == "__main__":
    main()
