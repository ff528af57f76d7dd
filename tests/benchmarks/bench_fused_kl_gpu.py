"""Fused top-k KL loss, forward + backward, side by side in one run at the README's six points
(d = 2048, k = 100, V in {49,152, 151,936} x N in {8K, 32K, 128K}, bf16).

Variants at each point, on the same inputs:
  bare   the three matmuls alone, z = h W^T, G W, G^T h, into preallocated outputs (the floor of
         any fused loss; 6 N d V FLOPs)
  liger  Liger-Kernel's fused linear cross-entropy (plain CE over the same three matmuls: another
         loss, the closest fused peer); skipped, with the reason recorded, where it is not importable
  ours   kernels.fused_topk_kl.fused_topk_kl (impl "auto": the Triton path on a GPU)
  sampled  the same loss on a sampled cache's targets (--samples slots per row with their
         weights, target_weights: the RS-KD estimator), at the same N, V: its cost beside top-k
  dense  kernels.fused_topk_kl.topk_kl_dense: full logits and autograd, the reference; "oom" is
         recorded where it does not fit
Before any timing: ours and sampled against dense (loss and both gradients) and Liger against our
cross-entropy (ce_weight = 1) at --check-rows rows of the largest vocabulary (harness.check_close).
One results row per (point, variant): median ms, peak GiB above the inputs, extra GiB (the peak
less the returned gradients), TFLOP/s of 6 N d V and its fraction of the device's bf16 matmul
ceiling, and the time over bare and over Liger (sampled: also over ours, x_ours).

--sweep first times the scaled row kernel's pass alone (FusedKLSettings.scaled_block x
scaled_warps) at each vocabulary's production chunk, as GB/s of one read and one write of the
chunk's logits against the device's copy ceiling (rows fused_kl_sweep/*), and then also times ours
with each vocabulary's fastest setting ("ours_best") where it is not the default.

The H200 run (repo root; liger-kernel importable, e.g. its wheel's folder on PYTHONPATH):

    PYTHONPATH=. python tests/benchmarks/bench_fused_kl_gpu.py --results tests/benchmarks/results.jsonl

The cost of sampled targets beside top-k alone (no Liger needed):

    PYTHONPATH=. python tests/benchmarks/bench_fused_kl_gpu.py --variants bare,ours,sampled \
        --results tests/benchmarks/results.jsonl

Without a GPU it runs the same code on the CPU (torch path, CPU timer, no Liger) at tiny sizes:

    PYTHONPATH=. python tests/benchmarks/bench_fused_kl_gpu.py --vocabs 1000 --rows 64,128 --d 32 --k 8 \\
        --check-rows 32 --results tests/benchmarks/out/fused_kl_cpu.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools

import torch
from harness import Results, add_results_arg, ceilings, check_close, gbps, tflops, time_cpu, time_gpu

import kernels.fused_topk_kl_triton as fkt
from kernels.fused_topk_kl import TAIL_MODES, FusedKLSettings, fused_topk_kl, topk_kl_dense
from kernels.fused_topk_kl_torch import row_weights, teacher_logprobs

GIB = 2**30
VARIANTS = ("bare", "liger", "ours", "sampled", "dense")


def make_inputs(n, v, d, k, dtype, device, seed=0):
    """Student (hidden, weight) and a cached top-k teacher: distinct random ids, 90% of the mass on
    them; targets for CE; a mask dropping about 10% of the rows."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, device=device).to(dtype)
    weight = (torch.randn(v, d, generator=gen, device=device) * (2.0 / d**0.5)).to(dtype)
    offsets_K = torch.randperm(v, generator=gen, device=device)[:k]
    shift_N = torch.randint(0, v, (n,), generator=gen, device=device)
    ids_NK = ((shift_N[:, None] + offsets_K[None, :]) % v).to(torch.int32)  # distinct in each row
    lp_NK = torch.log_softmax(torch.randn(n, k, generator=gen, device=device) * 2.0, dim=-1) + torch.log(
        torch.tensor(0.9, device=device))
    tail_N = torch.full((n,), float(torch.log(torch.tensor(0.1))), device=device)
    target_N = torch.randint(0, v, (n,), generator=gen, device=device)
    mask_N = torch.rand(n, generator=gen, device=device) > 0.1
    return hidden, weight, ids_NK, lp_NK, tail_N, target_N, mask_N


def make_sampled_inputs(n, v, d, samples, dtype, device, seed=0):
    """make_inputs with k = samples slots, plus a sampled cache's weights (counts / samples, r = p):
    per row `samples` draws over its slots from a peaked distribution, the slots ordered by count,
    so that rows repeat ids and end in padding slots of weight 0 as a real sampled cache does."""
    hidden, weight, ids_NK, lp_NK, tail_N, target_N, mask_N = make_inputs(n, v, d, samples, dtype, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    slot_p_NK = torch.softmax(torch.randn(n, samples, generator=gen, device=device) * 2.0, dim=-1)
    draws_NK = torch.multinomial(slot_p_NK, samples, replacement=True, generator=gen)
    counts_NK = torch.zeros(n, samples, device=device).scatter_add_(1, draws_NK, torch.ones_like(draws_NK).float())
    weights_NK = counts_NK.sort(dim=1, descending=True).values / samples
    return hidden, weight, ids_NK, lp_NK, tail_N, target_N, mask_N, weights_NK


def liger_loss():
    """Liger-Kernel's FLCE as a function (weight, hidden, target) -> loss, or the reason it is missing."""
    if not torch.cuda.is_available():
        return None, "needs a CUDA device"
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError as err:
        return None, f"liger_kernel not importable: {err}"
    module = LigerFusedLinearCrossEntropyLoss()

    def loss(weight, hidden, target):
        out = module(weight, hidden, target)
        return out[0] if isinstance(out, tuple) else out  # versions that also return a z-loss

    return loss, None


def grad_step(loss_fn, h, w):
    """One forward + backward: (loss, grad_h, grad_w), the gradients returned, not accumulated."""
    def step():
        loss = loss_fn(h, w)
        return (loss.detach(), *torch.autograd.grad(loss, (h, w)))
    return step


def loss_kw(args, target, mask, target_weights=None):
    """The loss's keywords; with target_weights (the sampled variant) its only tail, unnormalized."""
    tail = args.tail if target_weights is None else "unnormalized"
    return dict(target_ids=target, mask=mask, tail=tail, temperature=args.temperature,
                cache_temperature=args.temperature, ce_weight=args.ce_weight, check_ids=False,
                target_weights=target_weights)


def check(args, device, liger):
    """Ours against the dense reference, and Liger against our CE, before anything is timed."""
    v = max(args.vocabs)
    hidden, weight, ids, lp, tl, target, mask = make_inputs(args.check_rows, v, args.d, args.k, torch.bfloat16,
                                                            device, seed=1)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    kw = loss_kw(args, target, mask)
    pairs = [("ours", lambda h, w: fused_topk_kl(h, w, ids, lp, tl, **kw),
              lambda h, w: topk_kl_dense(h, w, ids, lp, tl, **kw))]
    _, _, s_ids, s_lp, s_tl, _, _, s_w = make_sampled_inputs(args.check_rows, v, args.d, args.samples, torch.bfloat16,
                                                             device, seed=1)
    s_kw = loss_kw(args, target, mask, s_w)
    pairs.append(("sampled", lambda h, w: fused_topk_kl(h, w, s_ids, s_lp, s_tl, **s_kw),
                  lambda h, w: topk_kl_dense(h, w, s_ids, s_lp, s_tl, **s_kw)))
    if liger is not None:
        ce = dict(kw, ce_weight=1.0, mask=None)
        pairs.append(("liger", lambda h, w: liger(w, h, target), lambda h, w: fused_topk_kl(h, w, ids, lp, tl, **ce)))
    errors = {}
    for name, fn, ref_fn in pairs:
        got, want = grad_step(fn, h, w)(), grad_step(ref_fn, h, w)()
        for part, g, r in zip(("loss", "grad_hidden", "grad_weight"), got, want):
            # bf16 bounds of tests/test_fused_topk_kl.py: loss relative, gradients against their largest entry
            tol = dict(atol=1e-4, rtol=5e-3) if part == "loss" else dict(atol=2e-2 * r.float().abs().max().item())
            errors[f"{name}/{part}"] = check_close(f"V{v}-N{args.check_rows} {name} {part}", g, r, **tol)
        del got, want
    print("check passed: max errors " + ", ".join(f"{k} {e:.3g}" for k, e in errors.items()), flush=True)
    return errors


def bare_step(hidden, weight):
    """The three matmuls into preallocated outputs; one [N, V] buffer serves as z and as G."""
    buf = torch.randn(hidden.shape[0], weight.shape[0], device=hidden.device, dtype=hidden.dtype)
    gh, gw = torch.empty_like(hidden), torch.empty_like(weight)

    def step():
        torch.mm(hidden, weight.T, out=buf)
        torch.mm(buf, weight, out=gh)
        torch.mm(buf.T, hidden, out=gw)
    return step


def sweep(args, device, settings, results):
    """The scaled row pass alone over blocks x warps at each vocabulary's production chunk; returns
    {V: the fastest settings}."""
    best = {}
    for v in args.vocabs:
        timed = sweep_vocabulary(args, device, v, settings, results)
        block, warps = min(timed, key=timed.get)
        best[v] = dataclasses.replace(settings, scaled_block=block, scaled_warps=warps)
        print(f"sweep V={v}: fastest {block} x {warps} warps; default {settings.scaled_block} x "
              f"{settings.scaled_warps}", flush=True)
        free(device)
    return best


def sweep_vocabulary(args, device, v, settings, results):
    """{(block, warps): ms of the row pass} at one vocabulary, each setting checked against the first."""
    rows = fkt.triton_chunk_size(max(args.rows), v, 2, settings.triton_chunk_bytes)
    hidden, weight, ids, lp, tl, _, _ = make_inputs(rows, v, args.d, args.k, torch.bfloat16, device)
    logp, logp_tail = teacher_logprobs(lp, tl, args.tail, 1.0, 1.0)
    logp = logp.contiguous()
    kl_w, ce_w = (t.float() for t in row_weights(None, None, rows, 0.0, 1.0, "mean", device))
    z0 = hidden @ weight.T
    z = torch.empty_like(z0)
    out = {n: torch.empty(rows, device=device) for n in ("loss", "kl", "sigma")}
    hs = torch.empty_like(hidden)
    moved = 2 * z0.numel() * z0.element_size()  # one read and one write of the chunk's logits
    copy = time_gpu(lambda: z.copy_(z0), warmup=3, repeats=20)
    timed, reference = {}, None
    for block, warps in itertools.product(args.sweep_blocks, args.sweep_warps):
        s = dataclasses.replace(settings, scaled_block=block, scaled_warps=warps)

        def step(s=s):
            z.copy_(z0)
            fkt._row_pass(z, ids, logp, logp_tail, None, kl_w, ce_w, out["loss"], out["kl"], hidden, out["sigma"],
                          hs, args.tail, 1.0, "scaled", s)

        step()
        grad = z.float() * out["sigma"][:, None]
        if reference is None:
            reference = (grad, out["loss"].clone())
        check_close(f"sweep V{v} {block}x{warps} gradient", grad, reference[0],
                    atol=1e-3 * reference[0].abs().max().item(), rtol=1e-2)
        check_close(f"sweep V{v} {block}x{warps} loss", out["loss"], reference[1], atol=1e-6, rtol=1e-4)
        del grad
        both = time_gpu(step, warmup=3, repeats=20)
        ms = max(both.median_ms - copy.median_ms, 1e-6)
        timed[(block, warps)] = ms
        results.add(f"V{v}-C{rows}/block{block}-warps{warps}",
                    dict(row_pass_ms=ms, with_copy_ms=both.median_ms, copy_ms=copy.median_ms, gbps=gbps(moved, ms),
                         of_copy_ceiling=gbps(moved, ms) / ceilings()["copy_gbps"]),
                    dict(V=v, chunk_rows=rows, d=args.d, k=args.k, tail=args.tail, block=block, warps=warps))
    return timed


def free(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_point(args, device, n, v, liger, liger_reason, settings, best, results, table):
    """Every variant at one point, bare and Liger first so that ours can be put against them."""
    timer = (lambda fn: time_gpu(fn, warmup=args.warmup, repeats=args.repeats)) if device == "cuda" else (
        lambda fn: time_cpu(fn, warmup=1, repeats=args.repeats))
    hidden, weight, ids, lp, tl, target, mask = make_inputs(n, v, args.d, args.k, torch.bfloat16, device)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    kw = loss_kw(args, target, mask)
    *_, s_ids, s_lp, s_tl, _, _, s_w = make_sampled_inputs(n, v, 1, args.samples, torch.bfloat16, device)
    s_kw = loss_kw(args, target, mask, s_w)
    flops = 6 * n * args.d * v
    outputs_gib = (h.numel() * h.element_size() + w.numel() * w.element_size()) / GIB
    chunk = fkt.triton_chunk_size(n, v, 2, settings.triton_chunk_bytes) if device == "cuda" else None
    steps = {
        "bare": lambda: bare_step(h.detach(), w.detach()),
        "liger": lambda: grad_step(lambda h, w: liger(w, h, target), h, w),
        "ours": lambda: grad_step(lambda h, w: fused_topk_kl(h, w, ids, lp, tl, settings=settings, **kw), h, w),
        "ours_best": lambda: grad_step(lambda h, w: fused_topk_kl(h, w, ids, lp, tl, settings=best[v], **kw), h, w),
        "sampled": lambda: grad_step(lambda h, w: fused_topk_kl(h, w, s_ids, s_lp, s_tl, settings=settings, **s_kw),
                                     h, w),
        "dense": lambda: grad_step(lambda h, w: topk_kl_dense(h, w, ids, lp, tl, **kw), h, w),
    }
    wanted = [x for x in VARIANTS if x in args.variants]
    if v in best and best[v] != settings and "ours" in wanted:
        wanted.insert(wanted.index("ours") + 1, "ours_best")
    ms_of = {}
    for name in wanted:
        config = dict(V=v, N=n, d=args.d, k=args.k, dtype="bfloat16", tail=args.tail, temperature=args.temperature,
                      ce_weight=args.ce_weight, device=device, torch=torch.__version__)
        if name.startswith("ours") or name == "sampled":
            config.update(chunk_rows=chunk, settings=best[v] if name == "ours_best" else settings)
        if name == "sampled":
            config.update(k=args.samples, tail="unnormalized", targets="sampled")
        if name == "liger" and liger is None:
            figures = dict(status="skipped", reason=liger_reason)
        else:
            try:
                timing = timer(steps[name]())
                ms_of[name] = timing.median_ms
                figures = dict(timing.figures(), tflops=tflops(flops, timing.median_ms))
                if device == "cuda":
                    figures["of_matmul_ceiling"] = figures["tflops"] / ceilings()["matmul_bf16_tflops"]
                    if name != "bare":
                        figures["extra_gib"] = timing.peak_gib - outputs_gib
                for peer in ("bare", "liger") + (("ours",) if name == "sampled" else ()):
                    if peer in ms_of and peer != name:
                        figures[f"x_{peer}"] = timing.median_ms / ms_of[peer]
            except torch.OutOfMemoryError:
                figures = dict(status="oom")
        free(device)
        table.append(results.add(f"V{v}-N{n}/{name}", figures, config))


def print_table(rows):
    print("\n| V | N | variant | ms | x bare | x Liger | x ours | TFLOP/s (6NdV) | of ceiling | extra GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        c, f = row["config"], row["figures"]
        if "median_ms" not in f:
            print(f"| {c['V']:,} | {c['N']:,} | {row['case'].split('/')[1]} | {f.get('status')} "
                  f"{f.get('reason', '')} | | | | | | |")
            continue
        cells = [f"{f[key]:.3f}" if key in f else "" for key in ("x_bare", "x_liger", "x_ours", "of_matmul_ceiling")]
        extra = f"{f['extra_gib']:.2f}" if "extra_gib" in f else ""
        print(f"| {c['V']:,} | {c['N']:,} | {row['case'].split('/')[1]} | {f['median_ms']:.2f} | {cells[0]} | "
              f"{cells[1]} | {cells[2]} | {f['tflops']:.0f} | {cells[3]} | {extra} |")


def ints(text):
    return [int(x) for x in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--vocabs", type=ints, default=[49152, 151936], help="vocabulary sizes V (comma-separated)")
    parser.add_argument("--rows", type=ints, default=[8192, 32768, 131072], help="token counts N (comma-separated)")
    parser.add_argument("--d", type=int, default=2048, help="hidden width")
    parser.add_argument("--k", type=int, default=100, help="cached top-k")
    parser.add_argument("--samples", type=int, default=12,
                        help="slots per row of the sampled variant (a sampled cache's --samples, the issue's default)")
    parser.add_argument("--tail", default="unnormalized", choices=TAIL_MODES)
    parser.add_argument("--temperature", type=float, default=1.0, help="distillation temperature (cache at the same)")
    parser.add_argument("--ce-weight", type=float, default=0.0)
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-rows", type=int, default=8192, help="rows of the correctness check before timing")
    parser.add_argument("--sweep", action="store_true", help="sweep the scaled row kernel's block x warps first")
    parser.add_argument("--sweep-blocks", type=ints, default=[2048, 4096, 8192, 16384])
    parser.add_argument("--sweep-warps", type=ints, default=[4, 8, 16, 32])
    add_results_arg(parser)
    args = parser.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants takes {','.join(VARIANTS)}, got {','.join(sorted(unknown))}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.sweep and device != "cuda":
        parser.error("--sweep times a Triton kernel and needs a CUDA device")
    settings = FusedKLSettings()
    liger, liger_reason = liger_loss()
    if device == "cuda":
        print(f"ceilings: {ceilings()}", flush=True)
    check(args, device, liger)
    free(device)
    best = sweep(args, device, settings, Results(bench="fused_kl_sweep", path=args.results)) if args.sweep else {}
    results, table = Results(bench="fused_kl", path=args.results), []
    for v in args.vocabs:
        for n in args.rows:
            measure_point(args, device, n, v, liger, liger_reason, settings, best, results, table)
            free(device)  # the point's inputs went with measure_point's frame
    print_table(table)


if __name__ == "__main__":
    main()
