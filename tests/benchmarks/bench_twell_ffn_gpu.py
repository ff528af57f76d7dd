"""TwELL sparse FFN (kernels/twell_ffn.py, impl="triton") against the dense gated FFN through
cuBLAS (torch autograd, no L1 term), side by side in one run, through tests/benchmarks/harness.py.

Shape: d 2048, dff 5632, 131,072 tokens, bf16. Synthetic inputs per --sparsities: the last input
feature holds a per-token threshold and w_gate's last column is -1, so row t has about counts[t]
positive gate entries, counts drawn lognormal (sigma 0.8: long per-row tails, as the paper
reports) around (1 - sparsity) dff. The columns are random, so blocks of tokens share few
neurons; a trained student's activations share more (sparse_ffn_real_gpu.py times those).

Per sparsity, before any timing, the TwELL path's y, l1 and four gradients are checked against
the torch path run in fp32 on the same bf16 inputs (relative error within FACTOR x the bf16 torch
path's + SLACK). Then one results row per (sparsity, variant, pass): variants `dense`, `twell`
(the default TwellSettings) and one per --settings; passes `fwd` and `fwd_bwd`. Figures: median
ms (CUDA events), peak GiB above the inputs, saved-activation GiB (bytes alive between forward and
backward, less the outputs), TFLOP/s (dense: its own, against the measured bf16 matmul ceiling;
twell: the dense FLOPs it stands for), speedup over dense. --profile adds each kernel's device
time (torch.profiler) to the twell rows, and the pack's count pass in GB/s against the copy
ceiling.

    PYTHONPATH=. python tests/benchmarks/bench_twell_ffn_gpu.py [--sparsities 0.95 0.99 0.995] [--profile]
    # on a CPU, under Triton's interpreter, at a toy size (checks the script, times nothing useful):
    TRITON_INTERPRET=1 PYTHONPATH=. python tests/benchmarks/bench_twell_ffn_gpu.py --tokens 64 \\
        --d-model 32 --d-ff 128 --repeats 1 --results /tmp/twell_cpu.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re

import torch

from harness import Results, add_results_arg, ceilings, check_close, gbps, tflops, time_cpu, time_gpu
from kernels.twell_ffn import TwellSettings, relu_gated_ffn

DTYPE = torch.bfloat16
L1_COEF = 2e-5
# Correctness bounds (as tests/test_twell_ffn.py's): under the interpreter bf16 casts truncate,
# which biases u and h toward zero by up to 2^-8 each
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FACTOR = 3.0 if _INTERPRETED else 1.5
SLACK = 8e-3 if _INTERPRETED else 1e-3
NAMES = ("y", "l1", "dx", "dw_gate", "dw_up", "dw_down")


def make_inputs(num_tokens, d_model, d_ff, sparsity, device, sigma=0.8, seed=0, chunk=16384):
    """(x, w_gate, w_up, w_down) in bf16 whose gate rows have lognormal counts around (1 - sparsity) dff."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x0 = torch.randn(num_tokens, d_model - 1, device=device, generator=gen).to(DTYPE)
    wg0 = (torch.randn(d_ff, d_model - 1, device=device, generator=gen) / math.sqrt(d_model)).to(DTYPE)
    raw = torch.exp(sigma * torch.randn(num_tokens, device=device, generator=gen, dtype=torch.float64))
    counts = (raw / raw.mean() * (1.0 - sparsity) * d_ff).round().clamp(0, d_ff).long()
    thr = torch.empty(num_tokens, 1, device=device)
    for r0 in range(0, num_tokens, chunk):
        desc = torch.sort(x0[r0:r0 + chunk].float() @ wg0.float().t(), dim=1, descending=True).values
        padded = torch.cat([desc[:, :1] + 1.0, desc, desc[:, -1:] - 1.0], dim=1)
        k = counts[r0:r0 + chunk, None]
        thr[r0:r0 + chunk] = 0.5 * (padded.gather(1, k) + padded.gather(1, k + 1))
    x = torch.cat([x0, thr.to(DTYPE)], dim=1)
    w_gate = torch.cat([wg0, -torch.ones(d_ff, 1, device=device, dtype=DTYPE)], dim=1).contiguous()
    w_up = (torch.randn(d_ff, d_model, device=device, generator=gen) / math.sqrt(d_model)).to(DTYPE)
    w_down = (torch.randn(d_model, d_ff, device=device, generator=gen) / math.sqrt(d_ff)).to(DTYPE)
    return x, w_gate, w_up, w_down


def dense_ffn(x, w_gate, w_up, w_down):
    """The peer: the dense gated FFN through cuBLAS, torch autograd, no L1 term."""
    return (torch.relu(x @ w_gate.t()) * (x @ w_up.t())) @ w_down.t()


def ell_width_for(sparsity, d_ff):
    """The ELL width a caller would pick: the default 128 where it is >= 2x the mean count, else
    3x the mean (rounded up to 16), so that rows at 90-95% do not mostly land in the backup."""
    mean = (1.0 - sparsity) * d_ff
    return 128 if 2 * mean <= 128 else min(d_ff, 16 * math.ceil(3 * mean / 16))


def parse_settings(text: str) -> TwellSettings:
    """A TwellSettings from JSON (lists become tuples), e.g. '{"block_m": 32, "stages": [2, 2]}'."""
    values = json.loads(text)
    return TwellSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def twell_variants(settings_list) -> list[tuple[str, TwellSettings]]:
    """("twell", the defaults) and, per TwellSettings of --settings, ("twell{changed fields}", it)."""
    default = TwellSettings()
    named = [("twell", default)]
    for settings in settings_list:
        changed = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
                   if getattr(settings, f.name) != getattr(default, f.name)}
        named.append((f"twell{json.dumps(changed, separators=(',', ':'))}", settings))
    return named


def _rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _outputs(params, grad_y, **kw):
    ps = [p.detach().clone().requires_grad_() for p in params]
    y, l1, stats = relu_gated_ffn(*ps, **kw)
    torch.autograd.backward([y, l1], [grad_y.to(y.dtype), torch.tensor(L1_COEF, device=y.device)])
    return [y.detach(), l1.detach()] + [p.grad for p in ps], stats


def check_twell(params, grad_y, **kw) -> tuple[dict, object]:
    """Refuse to time a wrong TwELL path: its y, l1 and gradients against the torch path in fp32
    on the same inputs, each within FACTOR x the bf16 torch path's error + SLACK (harness
    check_close raises otherwise). Returns ({name: relative error}, the call's FFNStats)."""
    got, stats = _outputs(params, grad_y, impl="triton", **kw)
    dense, _ = _outputs(params, grad_y, impl="torch")
    exact, _ = _outputs([p.float() for p in params], grad_y.float(), impl="torch")
    errors = {}
    for name, a, b, e in zip(NAMES, got, dense, exact):
        errors[name] = check_close(f"twell {name}: relative error against fp32", _rel_err(a, e), 0.0,
                                   atol=FACTOR * _rel_err(b, e) + SLACK)
    return errors, stats


def saved_bytes(forward) -> int:
    """Bytes alive after `forward()` above those before, less its outputs: what autograd keeps."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    outs = forward()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    return kept - sum(o.numel() * o.element_size() for o in outs if torch.is_tensor(o))


def breakdown(fn, iters=5) -> dict:
    """Device time per kernel (ms per call) over `iters` calls of fn, from torch.profiler: each of
    our Triton kernels by name, cuBLAS GEMMs together, and the rest as "other"."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.key
        if not re.fullmatch(r"_[a-z0-9_]+_kernel", name):  # ours: Triton names them so
            gemm = any(k in name.lower() for k in ("gemm", "nvjet", "sm90", "cutlass", "xmma"))
            name = "gemm" if gemm else "other"
        out[name] = out.get(name, 0.0) + evt.self_device_time_total / 1e3 / iters
    return {k: round(v, 4) for k, v in sorted(out.items())}


def measure(params, grad_y, variants, *, repeats, profile=False, ell_width=None, backup_rows=None):
    """{(variant, pass): figures} for the dense peer and each (name, TwellSettings) of `variants`,
    every TwELL variant checked first. params: (x, w_gate, w_up, w_down) requiring grad."""
    x, w_gate = params[0], params[1]
    num_tokens, d_model = x.shape
    d_ff = w_gate.shape[0]
    cuda = x.is_cuda
    timer = (lambda fn: time_gpu(fn, warmup=3, repeats=repeats)) if cuda else (
        lambda fn: time_cpu(fn, warmup=1, repeats=repeats))
    ceiling = ceilings() if cuda else {}
    flops = {"fwd": 6 * num_tokens * d_model * d_ff, "fwd_bwd": 18 * num_tokens * d_model * d_ff}
    coef = torch.tensor(L1_COEF, device=x.device)
    calls = {"dense": (lambda: (dense_ffn(*params),), (grad_y,))}
    checks = {}
    for name, settings in variants:
        kw = {"ell_width": ell_width, "backup_rows": backup_rows, "settings": settings}
        checks[name] = check_twell(params, grad_y, **kw)
        kw["impl"] = "triton"
        calls[name] = (lambda kw=kw: relu_gated_ffn(*params, **kw)[:2], (grad_y, coef))
    rows = {}
    for name, (forward, grads) in calls.items():
        passes = {"fwd": forward,
                  "fwd_bwd": lambda forward=forward, grads=grads: torch.autograd.grad(forward(), params, grads)}
        kept = saved_bytes(forward) if cuda else 0
        for pass_name, fn in passes.items():
            timing = timer(fn)
            fig = {**timing.figures(), "saved_gib": kept / 2**30, "tflops": tflops(flops[pass_name], timing.median_ms)}
            if name == "dense" and cuda:
                fig["matmul_ceiling_tflops"] = ceiling["matmul_bf16_tflops"]
                fig["fraction_of_ceiling"] = fig["tflops"] / ceiling["matmul_bf16_tflops"]
            if name != "dense":
                fig["speedup"] = rows["dense", pass_name]["median_ms"] / timing.median_ms
                errors, stats = checks[name]
                fig.update({f"rel_err_{k}": v for k, v in errors.items()})
                fig.update(nnz_mean=float(stats.nnz), overflow_rows=int(stats.overflow_rows),
                           fallback_rows=int(stats.fallback_rows))
                if profile and cuda:
                    fig["kernels_ms"] = breakdown(fn)
                    count_ms = fig["kernels_ms"].get("_count_kernel")
                    if count_ms:  # the pack's one read of the gate, against a copy
                        moved = num_tokens * d_ff * x.element_size() + num_tokens * d_ff // 8  # gate in, bits out
                        fig["count_pass_gbps"] = gbps(moved, count_ms)
                        fig["copy_ceiling_gbps"] = ceiling["copy_gbps"]
            rows[name, pass_name] = fig
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--sparsities", type=float, nargs="+", default=[0.99, 0.995])
    ap.add_argument("--repeats", type=int, default=20, help="timed calls a measurement (median)")
    ap.add_argument("--settings", type=parse_settings, nargs="*", default=[], metavar="JSON",
                    help="also time the TwELL path with these TwellSettings fields changed, e.g. '{\"block_m\": 32}'")
    ap.add_argument("--profile", action="store_true", help="each kernel's device time in the twell rows (CUDA)")
    add_results_arg(ap)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not _INTERPRETED:
        raise SystemExit("no CUDA device: run on a GPU, or on the CPU with TRITON_INTERPRET=1 at a toy size")
    results = Results(bench="twell_ffn", path=args.results)
    variants = twell_variants(args.settings)
    for sparsity in args.sparsities:
        params = [t.requires_grad_() for t in make_inputs(args.tokens, args.d_model, args.d_ff, sparsity, device)]
        grad_y = torch.randn(args.tokens, args.d_model, device=device, dtype=DTYPE)
        width = ell_width_for(sparsity, args.d_ff)
        rows = measure(params, grad_y, variants, repeats=args.repeats, profile=args.profile, ell_width=width)
        for (variant, pass_name), figures in rows.items():
            settings = dict(variants)[variant] if variant != "dense" else None
            config = {"tokens": args.tokens, "d_model": args.d_model, "d_ff": args.d_ff, "dtype": "bf16",
                      "sparsity": sparsity, "ell_width": width if settings else None, "settings": settings}
            results.add(f"s{sparsity:g}/{variant}/{pass_name}", figures, config)
        del params, grad_y
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'case':<34} {'ms':>8} {'x dense':>8} {'peak GiB':>9} {'saved GiB':>10} {'TFLOP/s':>8}")
    for row in results.rows:
        f = row["figures"]
        print(f"{row['case']:<34} {f['median_ms']:8.2f} {f.get('speedup', 1.0):8.3f} {f['peak_gib']:9.2f} "
              f"{f['saved_gib']:10.2f} {f['tflops']:8.1f}")


if __name__ == "__main__":
    main()
