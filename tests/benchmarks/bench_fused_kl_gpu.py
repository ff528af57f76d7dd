"""Fused top-k KL loss on a GPU, forward + backward, side by side in one run.

Variants (bf16, all on the same inputs): ours with impl="triton" (gradients in forward, 3
matmuls; "triton" the default: one stream, one logits buffer, automatic equal chunks
(commit 493ecb7 also had "triton_overlap", a two-stream schedule, since removed); "triton#ROWS", e.g. "triton#2048", the default
schedule at an explicit chunk_size, skipped where one buffer would pass 1 GiB), ours with impl="torch" (recompute in backward, 4 matmuls), the dense torch top-k KL
(`topk_kl_dense`, full logits; OOM is reported), "triton_direct" (the same with the two-read
row kernel that writes the gradient itself, the one "triton" used before the one-read "scaled"
kernel), Liger-Kernel's LigerFusedLinearCrossEntropyLoss
(the closest fused peer; plain CE, so a different loss over the same matmuls), and the bare
matmuls z = h W^T, G W, G^T h with a random G of the same shapes (the floor for any fused loss).
Before timing, a correctness check against the dense reference (and triton vs torch) at one
small and one large shape.

Time: CUDA events around one forward + backward, after warm-up, median of --repeats. Extra peak
memory: max_memory_allocated during one forward + backward minus what the inputs and the
outputs (loss, grad_hidden, grad_weight) hold. Run from the repo root on the GPU machine:

    PYTHONPATH=. python tests/benchmarks/bench_fused_kl_gpu.py --out /tmp/bench_fused_kl.json

Prints a table and writes every number as JSON to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path

import torch

import kernels.fused_topk_kl_triton as fkt
from kernels.fused_topk_kl import fused_topk_kl, topk_kl_dense
from kernels.fused_topk_kl_triton import triton_chunk_size

GIB = 2**30


def make_inputs(n, v, d, k, dtype, seed=0):
    """Student (hidden, weight) and a cached top-k teacher: distinct random ids, 90% mass on S."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, device="cuda").to(dtype)
    weight = (torch.randn(v, d, generator=gen, device="cuda") * (2.0 / d**0.5)).to(dtype)
    offsets_K = torch.randperm(v, generator=gen, device="cuda")[:k]
    shift_N = torch.randint(0, v, (n,), generator=gen, device="cuda")
    ids_NK = ((shift_N[:, None] + offsets_K[None, :]) % v).to(torch.int32)  # distinct in each row
    lp_NK = torch.log_softmax(torch.randn(n, k, generator=gen, device="cuda") * 2.0, dim=-1) + torch.log(
        torch.tensor(0.9, device="cuda"))
    tail_N = torch.full((n,), float(torch.log(torch.tensor(0.1))), device="cuda")
    target_N = torch.randint(0, v, (n,), generator=gen, device="cuda")
    mask_N = torch.rand(n, generator=gen, device="cuda") > 0.1
    return hidden, weight, ids_NK, lp_NK, tail_N, target_N, mask_N


def loss_and_grads(fn, hidden, weight, teacher, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = fn(h, w, *teacher, **kw)
    loss.backward()
    return loss.detach().float(), h.grad.float(), w.grad.float()


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(n, v, d, k, dtype, configs):
    """Relative errors of triton and torch paths against dense (dense in fp32 where it fits)."""
    hidden, weight, ids, lp, tl, target, mask = make_inputs(n, v, d, k, dtype, seed=1)
    rows = []
    for cfg in configs:
        kw = dict(target_ids=target, mask=mask, check_ids=True, **cfg)
        ref = loss_and_grads(topk_kl_dense, hidden, weight, (ids, lp, tl), **kw)
        tri = loss_and_grads(fused_topk_kl, hidden, weight, (ids, lp, tl), impl="triton", **kw)
        tor = loss_and_grads(fused_topk_kl, hidden, weight, (ids, lp, tl), impl="torch", **kw)
        row = dict(shape=(n, v, d, k), dtype=str(dtype), **cfg)
        for name, got, want in (("triton_vs_dense", tri, ref), ("torch_vs_dense", tor, ref),
                                ("triton_vs_torch", tri, tor)):
            row[name] = [rel_err(g, r) for g, r in zip(got, want)]
        bound = 2e-2 if dtype == torch.bfloat16 else 1e-4
        row["ok"] = all(e < bound for e in row["triton_vs_dense"] + row["triton_vs_torch"])
        rows.append(row)
        print(f"check {row['shape']} {dtype} {cfg}: triton/dense (loss, gh, gw) "
              + " ".join(f"{e:.1e}" for e in row["triton_vs_dense"])
              + " | triton/torch " + " ".join(f"{e:.1e}" for e in row["triton_vs_torch"])
              + ("" if row["ok"] else "  FAIL"), flush=True)
    del hidden, weight
    return rows


def measure(step, leaves, warmup, repeats):
    """Median ms of step() (one forward + backward) and its extra peak memory in bytes."""
    for _ in range(warmup):
        for t in leaves:
            t.grad = None
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        for t in leaves:
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    for t in leaves:
        t.grad = None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    held = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
    held += out.numel() * out.element_size() if out is not None else 0
    extra = torch.cuda.max_memory_allocated() - base - held
    for t in leaves:
        t.grad = None
    return statistics.median(times), extra, times


def variants(args, hidden, weight, teacher, target):
    ids, lp, tl = teacher
    kw = dict(tail=args.tail, temperature=args.temperature, ce_weight=args.ce_weight, check_ids=False,
              target_ids=target if args.ce_weight > 0 else None)
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()

    def ours(impl, chunk_rows=None, row_kernel="scaled"):
        def step():
            fkt.ROW_KERNEL = row_kernel
            try:
                loss = fused_topk_kl(h, w, ids, lp, tl, impl=impl, chunk_size=chunk_rows, **kw)
                loss.backward()
            finally:
                fkt.ROW_KERNEL = "scaled"
            return loss.detach()
        return step

    def dense():
        loss = topk_kl_dense(h, w, ids, lp, tl, **kw)
        loss.backward()
        return loss.detach()

    def liger():
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss()(w, h, target)
        loss.backward()
        return loss.detach()

    steps = {"triton": ours("triton"), "triton_direct": ours("triton", row_kernel="direct"), "torch": ours("torch"),
             "dense": dense, "liger": liger}
    for name in args.variants.split(","):
        if "#" in name:
            rows = int(name.split("#")[1])
            if rows <= hidden.shape[0] and rows * weight.shape[0] * weight.element_size() <= GIB:
                steps[name] = ours("triton", rows)
    return h, w, steps


def bare_matmuls(hidden, weight, warmup, repeats):
    """z = h W^T, grad_h = G W, grad_W = G^T h into preallocated outputs, G random."""
    n, v = hidden.shape[0], weight.shape[0]
    g_NV = torch.randn(n, v, device="cuda", dtype=hidden.dtype)
    z_NV = torch.empty_like(g_NV)
    gh, gw = torch.empty_like(hidden), torch.empty_like(weight)

    def step():
        torch.mm(hidden, weight.T, out=z_NV)
        torch.mm(g_NV, weight, out=gh)
        torch.mm(g_NV.T, hidden, out=gw)
        return None

    result = measure(step, [], warmup, repeats)
    del g_NV, z_NV, gh, gw
    return result


def profile_step(step, leaves, label):
    """GPU time per kernel of one forward + backward (torch.profiler), and the step's wall time:
    what the time beyond the bare matmuls is spent on (small kernels, or the GPU waiting on Python)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        for t in leaves:
            t.grad = None
        step()
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
    for t in leaves:
        t.grad = None
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    busy_ms = sum(e.device_time_total for e in kernels) / 1e3
    rows = sorted(((e.key[:70], e.count, e.device_time_total / 1e3) for e in kernels), key=lambda r: -r[2])
    print(f"\nprofile {label}: wall {start.elapsed_time(end):.2f} ms (under the profiler), "
          f"GPU kernels {busy_ms:.2f} ms")
    for name, count, ms in rows[:14]:
        print(f"  {ms:8.3f} ms  x{count:<4d} {name}")
    return dict(label=label, wall_ms=start.elapsed_time(end), kernel_ms=busy_ms, kernels=rows[:30])


def copy_bandwidth():
    x = torch.empty(2 * GIB // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms, _, _ = measure(lambda: y.copy_(x), [], 3, 10)
    del x, y
    return 2 * 2 * GIB / (ms * 1e-3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--vocabs", default="49152,151936")
    parser.add_argument("--rows", default="8192,32768,131072")
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--tail", default="unnormalized", choices=["renorm", "bucket", "unnormalized"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ce-weight", type=float, default=0.0)
    parser.add_argument("--variants", default="bare,triton,torch,liger,dense")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of the 'triton' variant at every shape")
    args = parser.parse_args()
    dtype = torch.bfloat16
    report = dict(args=vars(args), device=torch.cuda.get_device_name(), torch=torch.__version__)
    import triton

    report["triton"] = triton.__version__
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version

        report["liger_kernel"] = version("liger_kernel")
    except ImportError as err:
        report["liger_kernel"] = f"not importable: {err}"

    if not args.skip_check:
        small = [dict(tail=t, temperature=tt, ce_weight=c) for t in ("renorm", "bucket", "unnormalized")
                 for tt, c in ((1.0, 0.0), (2.0, 0.3))]
        report["check"] = check(1031, 12365, 256, args.k, torch.float32, small)
        report["check"] += check(1031, 12365, 256, args.k, dtype, small)
        large = [dict(tail=args.tail, temperature=args.temperature, ce_weight=args.ce_weight),
                 dict(tail="bucket", temperature=2.0, ce_weight=0.3),
                 dict(tail="bucket", temperature=1.0, ce_weight=0.3)]
        report["check"] += check(8192, 151936, args.d, args.k, dtype, large)
        torch.cuda.empty_cache()
    report["copy_GBps"] = copy_bandwidth() / 1e9
    print(f"device-to-device copy: {report['copy_GBps']:.0f} GB/s (read + write)", flush=True)

    wanted = args.variants.split(",")
    results = []
    for v in (int(x) for x in args.vocabs.split(",")):
        for n in (int(x) for x in args.rows.split(",")):
            hidden, weight, ids, lp, tl, target, _ = make_inputs(n, v, args.d, args.k, dtype)
            flops = 3 * 2 * n * v * args.d
            if "bare" in wanted:
                wanted_here = ["bare"] + [x for x in wanted if x != "bare"]
            else:
                wanted_here = wanted
            h, w, steps = variants(args, hidden, weight, (ids, lp, tl), target)
            if args.profile:
                try:
                    report.setdefault("profile", []).append(
                        profile_step(steps["triton"], [h, w], f"triton V={v} N={n}"))
                except Exception as err:  # noqa: BLE001  the profile is a diagnostic, not the result
                    print(f"profile failed: {type(err).__name__}: {err}", flush=True)
            for name in [x for x in wanted_here if x in steps or x == "bare"]:
                row = dict(V=v, N=n, d=args.d, k=args.k, variant=name)
                try:
                    if name == "bare":
                        ms, extra, times = bare_matmuls(hidden, weight, args.warmup, args.repeats)
                    else:
                        ms, extra, times = measure(steps[name], [h, w], args.warmup, args.repeats)
                    row.update(ms=ms, times_ms=times, extra_GiB=extra / GIB, TFLOPs=flops / (ms * 1e-3) / 1e12)
                except torch.OutOfMemoryError:
                    row.update(ms=None, error="OOM")
                except Exception as err:  # noqa: BLE001  a peer that fails is reported, not fatal
                    row.update(ms=None, error=f"{type(err).__name__}: {err}"[:300])
                h.grad = w.grad = None
                gc.collect()
                torch.cuda.empty_cache()
                results.append(row)
                print(json.dumps({key: row[key] for key in row if key != "times_ms"}), flush=True)
            del hidden, weight, ids, lp, tl, target, h, w, steps
            gc.collect()
            torch.cuda.empty_cache()
    report["results"] = results
    report["chunk_rows_triton"] = {f"{v}x{n}": triton_chunk_size(int(n), int(v), 2)
                                   for v in args.vocabs.split(",") for n in args.rows.split(",")}
    print("auto chunk rows (V x N: rows):", report["chunk_rows_triton"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))

    print("\n| V | N | variant | ms | x bare | TFLOP/s (6NVd) | extra peak GiB |")
    print("|---|---|---|---|---|---|---|")
    bare = {(r["V"], r["N"]): r["ms"] for r in results if r["variant"] == "bare" and r["ms"]}
    for r in results:
        if r["ms"] is None:
            print(f"| {r['V']:,} | {r['N']:,} | {r['variant']} | {r['error'][:40]} | | | |")
            continue
        ratio = f"{r['ms'] / bare[(r['V'], r['N'])]:.3f}" if (r["V"], r["N"]) in bare else ""
        print(f"| {r['V']:,} | {r['N']:,} | {r['variant']} | {r['ms']:.1f} | {ratio} | {r['TFLOPs']:.0f} "
              f"| {r['extra_GiB']:.2f} |")


if __name__ == "__main__":
    main()
