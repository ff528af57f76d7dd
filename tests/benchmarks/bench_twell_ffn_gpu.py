"""Sparse ReLU-gated FFN (kernels/twell_ffn.py, impl="triton") against the dense gated FFN through
cuBLAS with torch autograd, side by side in one run on one GPU.

Shapes: d=2048, dff=5632, 131,072 tokens, bf16 (the issue's). Gate sparsity is set by synthetic
inputs: the last input feature holds a per-token threshold and w_gate's last column is -1, so row t
has about counts[t] positive gate entries, counts drawn lognormal (sigma 0.8: per-row maxima 15-25x
the mean, as the paper reports >10x). Every configuration is checked against the dense torch path
before it is timed. Times: CUDA events through triton.testing.do_bench, median. Memory: bytes
alive between forward and backward (activations saved, minus the output y) and the peak over
forward + backward above the inputs. Prints a table; writes JSON with --out.

    PYTHONPATH=. python tests/benchmarks/bench_twell_ffn_gpu.py --out twell.json [--variants]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re

import torch
import triton
import triton.language as tl

import kernels.twell_ffn as twell
from kernels.twell_ffn import relu_gated_ffn

DTYPE = torch.bfloat16


def make_inputs(num_tokens, d_model, d_ff, sparsity, sigma=0.8, seed=0, chunk=16384):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x0 = torch.randn(num_tokens, d_model - 1, device="cuda", generator=gen).to(DTYPE)
    wg0 = (torch.randn(d_ff, d_model - 1, device="cuda", generator=gen) / math.sqrt(d_model)).to(DTYPE)
    raw = torch.exp(sigma * torch.randn(num_tokens, device="cuda", generator=gen, dtype=torch.float64))
    counts = (raw / raw.mean() * (1.0 - sparsity) * d_ff).round().clamp(0, d_ff).long()
    thr = torch.empty(num_tokens, 1, device="cuda")
    for r0 in range(0, num_tokens, chunk):
        desc = torch.sort(x0[r0:r0 + chunk].float() @ wg0.float().t(), dim=1, descending=True).values
        padded = torch.cat([desc[:, :1] + 1.0, desc, desc[:, -1:] - 1.0], dim=1)
        k = counts[r0:r0 + chunk, None]
        thr[r0:r0 + chunk] = 0.5 * (padded.gather(1, k) + padded.gather(1, k + 1))
    x = torch.cat([x0, thr.to(DTYPE)], dim=1)
    w_gate = torch.cat([wg0, -torch.ones(d_ff, 1, device="cuda", dtype=DTYPE)], dim=1).contiguous()
    w_up = (torch.randn(d_ff, d_model, device="cuda", generator=gen) / math.sqrt(d_model)).to(DTYPE)
    w_down = (torch.randn(d_model, d_ff, device="cuda", generator=gen) / math.sqrt(d_ff)).to(DTYPE)
    return x, w_gate, w_up, w_down


def dense_ffn(x, w_gate, w_up, w_down):
    """The peer: the dense gated FFN through cuBLAS, torch autograd, no L1 term."""
    return (torch.relu(x @ w_gate.t()) * (x @ w_up.t())) @ w_down.t()


def row_counts(x, w_gate, chunk=16384):
    return torch.cat([((x[r0:r0 + chunk] @ w_gate.t()) > 0).sum(1) for r0 in range(0, x.shape[0], chunk)])


def sparse_call(params, **kw):
    y, l1, _ = relu_gated_ffn(*params, impl="triton", **kw)
    return y, l1


def fwd_bwd_sparse(params, grad_y, l1_coef, **kw):
    y, l1 = sparse_call(params, **kw)
    torch.autograd.backward([y, l1], [grad_y, torch.tensor(l1_coef, device="cuda")])


def fwd_bwd_dense(params, grad_y):
    dense_ffn(*params).backward(grad_y)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check(params, grad_y, l1_coef, **kw):
    """Rel. errors of the triton path against the dense torch path (both bf16) on y, l1, 4 grads."""
    errs, outs = {}, {}
    for impl in ("triton", "torch"):
        ps = [p.detach().clone().requires_grad_() for p in params]
        y, l1, stats = relu_gated_ffn(*ps, impl=impl, **(kw if impl == "triton" else {}))
        torch.autograd.backward([y, l1], [grad_y, torch.tensor(l1_coef, device="cuda")])
        outs[impl] = [y.detach(), l1.detach()] + [p.grad for p in ps]
        if impl == "triton":
            outs["stats"] = stats
        del y, l1, ps
    for name, a, b in zip(("y", "l1", "dx", "dw_gate", "dw_up", "dw_down"), outs["triton"], outs["torch"]):
        errs[name] = rel_err(a, b)
        assert torch.isfinite(a).all(), f"{name}: non-finite output"
    return errs, outs["stats"]


def time_ms(fn, params, rep_ms):
    return triton.testing.do_bench(fn, warmup=50, rep=rep_ms, grad_to_none=list(params), return_mode="median")


def memory(fwd, params, grad_of_outputs):
    """(bytes alive after forward minus the outputs, peak bytes over forward + backward) above inputs."""
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = fwd()
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base - sum(o.numel() * o.element_size() for o in outs)
    torch.autograd.backward(list(outs), grad_of_outputs[:len(outs)])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del outs
    for p in params:
        p.grad = None
    return saved, peak


def breakdown(fn, iters=5):
    """Device time per kernel family (ms per call) over `iters` calls of fn, from torch.profiler:
    the cuBLAS GEMMs, each of our Triton kernels (by its name), and the rest (memsets, argsort,
    copies, reductions)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out, other = {}, {}
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name, ms = evt.key, evt.self_device_time_total / 1e3 / iters
        fam = name if re.fullmatch(r"_[a-z0-9_]+_kernel", name) else None  # ours (Triton names them so)
        if fam is None and any(k in name.lower() for k in ("gemm", "nvjet", "sm90", "cutlass", "xmma")):
            fam = "gemm"
        if fam is None:
            fam = "other"
            other[name[:60]] = round(ms, 3)
        out[fam] = out.get(fam, 0.0) + ms
    out = {k: round(v, 3) for k, v in sorted(out.items())}
    out["other_top"] = dict(sorted(other.items(), key=lambda kv: -kv[1])[:6])
    return out


@triton.jit
def _gather_sum_kernel(table_ptr, idx_ptr, out_ptr, D, S, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[m, cols] = sum over j < S of table[idx[m, j], cols]: the SpMM's access pattern alone."""
    m = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    for j0 in range(0, S, BLOCK_S):
        j = j0 + tl.arange(0, BLOCK_S)
        n = tl.load(idx_ptr + m * S + j, mask=j < S, other=0).to(tl.int64)
        acc += tl.load(table_ptr + n[:, None] * D + k[None, :], mask=(j < S)[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + m * D + k, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty))


def measure_ceilings(num_tokens=131072, d_model=2048, per_row=56):
    """Copy bandwidth, bf16 GEMM rate, and the rate of gathering per_row random rows of a table a
    token (bytes of gathered rows / time) for tables of L2 size and above."""
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    t = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    src = torch.randn(2**27, device="cuda")  # 512 MiB of fp32
    dst = torch.empty_like(src)
    tc = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    out = {"bf16_gemm_tflops": 2 * 8192**3 / t / 1e9, "copy_gbps": 2 * src.numel() * 4 / tc / 1e6}
    y = torch.empty(num_tokens, d_model, device="cuda", dtype=DTYPE)
    for rows in (1408, 5632, 11264):
        table = torch.randn(rows, d_model, device="cuda", dtype=DTYPE)
        idx = torch.randint(0, rows, (num_tokens, per_row), device="cuda", dtype=torch.int32)
        grid = (num_tokens, d_model // 1024)
        tg = triton.testing.do_bench(lambda: _gather_sum_kernel[grid](table, idx, y, d_model, per_row,
                                                                      BLOCK_S=8, BLOCK_D=1024),
                                     warmup=20, rep=200, return_mode="median")
        out[f"gather_gbps_table_{rows * d_model * 2 >> 20}MiB"] = num_tokens * per_row * d_model * 2 / tg / 1e6
    return out


def run_config(params, grad_y, l1_coef, rep_ms, label, **kw):
    fwd_ms = time_ms(lambda: sparse_call(params, **kw), params, rep_ms)
    fb_ms = time_ms(lambda: fwd_bwd_sparse(params, grad_y, l1_coef, **kw), params, 2 * rep_ms)
    return {"label": label, "fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms}


VARIANT_KEYS = ("_DENSE_DH_DENSITY", "_DH_BLOCK", "_SDDMM_BLOCKS", "_SPMM_BLOCKS", "_WIDE_ROWS_DIV", "_LONG_LIST",
                "_UNION_FORWARD", "_UNION_BACKWARD", "_UNION_BM", "_UNION_UP_BLOCKS", "_UNION_DOWN_BLOCKS", "_UNION_WARPS", "_UNION_SPLIT",
                "_UNION_STAGES", "_UNION_SLICES_OUTER")


def set_variant(values):
    for key, value in zip(VARIANT_KEYS, values):
        setattr(twell, key, value)


def ell_width_for(sparsity, d_ff):
    """The ELL width a caller would pick: the default 128 where it is >= 2x the mean count, else
    3x the mean (rounded up to 16): at 90-95% the default would send most rows to the backup."""
    mean = (1.0 - sparsity) * d_ff
    return 128 if 2 * mean <= 128 else min(d_ff, 16 * math.ceil(3 * mean / 16))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--sparsities", type=float, nargs="+", default=[0.90, 0.95, 0.99, 0.995])
    ap.add_argument("--rep-ms", type=int, default=300, help="do_bench repetition time per forward timing")
    ap.add_argument("--variants", action="store_true", help="also sweep settings at 99%% and 99.5%%")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    # forward and backward by the gathers; the forward by blocks with the gather backward; then both
    # by blocks with one setting changed (the gather kernels' blocks, the dh route and the wide
    # launches were swept at earlier commits: RESULTS.md)
    defaults = tuple(getattr(twell, key) for key in VARIANT_KEYS)
    names = {key: i for i, key in enumerate(VARIANT_KEYS)}
    blocks = {"_UNION_FORWARD": True, "_UNION_BACKWARD": True}
    outer = {"_UNION_SLICES_OUTER": True}
    changes = [{"_UNION_FORWARD": False, "_UNION_BACKWARD": False}, {"_UNION_BACKWARD": False},
               {"_UNION_DOWN_BLOCKS": (32, 256)}, {"_UNION_WARPS": (4, 4)},
               outer]
    args.variant_list = []
    for change in changes:
        values = list(defaults)
        for key, value in {**blocks, **change}.items():
            values[names[key]] = value
        args.variant_list.append(tuple(values))
    l1_coef = 2e-5
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": args.commit, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "shape": [args.tokens, args.d_model, args.d_ff],
              "ceilings": measure_ceilings(), "rows": [], "variants": []}
    print("ceilings", result["ceilings"], flush=True)

    def save():  # after every row: a run cut short still leaves its numbers
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1)
    dense = None
    for sp in args.sparsities:
        x, w_gate, w_up, w_down = make_inputs(args.tokens, args.d_model, args.d_ff, sp)
        params = [t.requires_grad_() for t in (x, w_gate, w_up, w_down)]
        grad_y = torch.randn(args.tokens, args.d_model, device="cuda", dtype=DTYPE)
        counts = row_counts(x, w_gate).float()
        width = ell_width_for(sp, args.d_ff)
        errs, stats = check(params, grad_y, l1_coef, ell_width=width)
        row = {"sparsity_target": sp, "ell_width": width, "nnz_mean": counts.mean().item(),
               "nnz_max": counts.max().item(),
               "overflow_rows": int(stats.overflow_rows), "fallback_rows": int(stats.fallback_rows),
               "rel_err_vs_dense_bf16": errs}
        if dense is None:  # the dense layer's time and memory do not depend on the sparsity
            dense = {"fwd_ms": time_ms(lambda: dense_ffn(*params), params, args.rep_ms),
                     "fwd_bwd_ms": time_ms(lambda: fwd_bwd_dense(params, grad_y), params, 2 * args.rep_ms)}
            dense["saved_bytes"], dense["peak_bytes"] = memory(lambda: (dense_ffn(*params),), params, [grad_y])
            result["dense"] = dense
            print("dense", dense, flush=True)
        row.update(run_config(params, grad_y, l1_coef, args.rep_ms, "base", ell_width=width))
        one = torch.tensor(l1_coef, device="cuda")
        row["saved_bytes"], row["peak_bytes"] = memory(lambda: sparse_call(params, ell_width=width), params,
                                                       [grad_y, one])
        row["breakdown_fwd_ms"] = breakdown(lambda: sparse_call(params, ell_width=width))
        row["breakdown_fwd_bwd_ms"] = breakdown(lambda: fwd_bwd_sparse(params, grad_y, l1_coef, ell_width=width))
        row["fwd_speedup"] = dense["fwd_ms"] / row["fwd_ms"]
        row["fwd_bwd_speedup"] = dense["fwd_bwd_ms"] / row["fwd_bwd_ms"]
        row["saved_ratio"] = row["saved_bytes"] / dense["saved_bytes"]
        row["peak_ratio"] = row["peak_bytes"] / dense["peak_bytes"]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        save()
        if args.variants and min(abs(sp - 0.99), abs(sp - 0.995)) < 1e-9:
            base = tuple(getattr(twell, key) for key in VARIANT_KEYS)
            for var in args.variant_list:
                set_variant(var)
                errs_v, _ = check(params, grad_y, l1_coef)
                rec = run_config(params, grad_y, l1_coef, args.rep_ms, str(dict(zip(VARIANT_KEYS, var))))
                rec["sparsity_target"] = sp
                rec["max_rel_err"] = max(errs_v.values())
                rec["breakdown_fwd_ms"] = breakdown(lambda: sparse_call(params))
                rec["breakdown_fwd_bwd_ms"] = breakdown(lambda: fwd_bwd_sparse(params, grad_y, l1_coef))
                result["variants"].append(rec)
                print("variant", json.dumps(rec), flush=True)
                save()
            set_variant(base)
        del params, x, w_gate, w_up, w_down, grad_y
        torch.cuda.empty_cache()
    if dense is not None:  # timed again last: the spread of two timings of one version
        x, w_gate, w_up, w_down = make_inputs(args.tokens, args.d_model, args.d_ff, 0.99)
        params = [t.requires_grad_() for t in (x, w_gate, w_up, w_down)]
        grad_y = torch.randn(args.tokens, args.d_model, device="cuda", dtype=DTYPE)
        result["dense_again"] = {"fwd_ms": time_ms(lambda: dense_ffn(*params), params, args.rep_ms),
                                 "fwd_bwd_ms": time_ms(lambda: fwd_bwd_dense(params, grad_y), params,
                                                       2 * args.rep_ms)}
    print(f"\n{'sparsity':>8} {'W':>5} {'nnz':>6} {'max':>5} {'ovf':>6} {'fb':>4} {'fwd ms':>7} {'x':>5} "
          f"{'f+b ms':>7} {'x':>5} {'saved':>6} {'peak':>6} {'maxerr':>7}  forward kernels ms")
    print(f"{'dense':>8} {'':>5} {'':>6} {'':>5} {'':>6} {'':>4} {dense['fwd_ms']:7.2f} {'':>5} "
          f"{dense['fwd_bwd_ms']:7.2f} {'':>5} {dense['saved_bytes'] / 2**30:5.2f}G "
          f"{dense['peak_bytes'] / 2**30:5.2f}G")
    for r in result["rows"]:
        b = r["breakdown_fwd_ms"]
        print(f"{r['sparsity_target']:8.3f} {r['ell_width']:5d} {r['nnz_mean']:6.1f} {r['nnz_max']:5.0f} "
              f"{r['overflow_rows']:6d} {r['fallback_rows']:4d} {r['fwd_ms']:7.2f} {r['fwd_speedup']:5.2f} "
              f"{r['fwd_bwd_ms']:7.2f} {r['fwd_bwd_speedup']:5.2f} {r['saved_bytes'] / 2**30:5.2f}G "
              f"{r['peak_bytes'] / 2**30:5.2f}G "
              f"{max(r['rel_err_vs_dense_bf16'].values()):7.1e}  {b}")
    for v in result["variants"]:
        print(f"variant {v['label']}: fwd {v['fwd_ms']:.2f} ms, fwd+bwd {v['fwd_bwd_ms']:.2f} ms, "
              f"max err {v['max_rel_err']:.1e}, forward kernels {v['breakdown_fwd_ms']}")
    if "dense_again" in result:
        print("dense again", result["dense_again"])
    save()


if __name__ == "__main__":
    main()
