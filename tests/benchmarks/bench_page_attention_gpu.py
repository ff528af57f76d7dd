"""Page attention, forward + backward, as the chunk-recurrent engine uses it: one chunk of Tq queries
at positions [T_past, T_past + Tq) against every earlier key and its own (causal), keys in pages of
--page tokens, bf16, for the Qwen2-0.5B head shape (14 query / 2 kv heads, D 64) and the Qwen2.5-3B
one (16 / 2, D 128).

Variants of the same exact computation, on the same inputs:
  ours   kernels.page_attention: forward over the page table (cuDNN's fused attention on the table's
         pages gathered, in pieces, LSE-merged), backward with the merged out and lse adding dk, dv
         into fp32 gradient pools (the engine's call sequence; the pools are not zeroed in the timed
         loop; the gathers are timed)
  flex   torch.nn.attention.flex_attention, compiled, return_lse, a causal block mask with the chunk's
         offset, over a contiguous [B, Hkv, T, D] copy of the keys (the copy is not timed)
  sdpa   FlashAttention through aten's flash op: past keys without a mask plus the chunk's own keys
         with is_causal, LSE-merged; backward of both parts with the merged out and lse (exact);
         kv heads repeated to the query heads (the op takes no GQA); skipped where the op is missing
Before timing: ours against the torch reference (fp32, small) and, at every case, flex and sdpa
against ours (out, lse, dq, dk, dv; a variant that disagrees is recorded as a mismatch, not timed).
Rows `page_attention/<shape>-Tq<Tq>-Tk<T_past>/<variant>`: median ms of fwd+bwd and of the forward
alone, TFLOP/s counting 4 Tq Tvis D H for the forward (Tvis: the mean visible keys) and 2.5x that
for the backward, its fraction of the bf16 matmul ceiling, peak GiB above the inputs.

The H200 run (repo root, about 4 minutes):

    PYTHONPATH=. python tests/benchmarks/bench_page_attention_gpu.py --results tests/benchmarks/results.jsonl

On the CPU (torch path, tiny):

    PYTHONPATH=. python tests/benchmarks/bench_page_attention_gpu.py --shapes tiny --tq 32 --tk 64 \\
        --results tests/benchmarks/out/page_attention_cpu.jsonl
"""

from __future__ import annotations

import argparse
import gc
import math

import torch
from harness import Results, add_results_arg, ceilings, check_close, tflops, time_cpu, time_gpu

from kernels.page_attention import page_attention_backward, page_attention_forward

SHAPES = {"qwen2-0.5b": (14, 2, 64), "qwen2.5-3b": (16, 2, 128), "tiny": (4, 2, 16)}  # (H, Hkv, D)
GIB = 2**30


def make_inputs(H, Hkv, D, Tq, T_past, P, device, dtype=torch.bfloat16, seed=0):
    """q, the chunk's dout, pools holding positions [0, T_past + Tq) in shuffled slots, the table."""
    gen = torch.Generator(device=device).manual_seed(seed)
    N = math.ceil((T_past + Tq) / P)
    q = torch.randn(1, H, Tq, D, generator=gen, device=device).to(dtype)
    dout = torch.randn(1, H, Tq, D, generator=gen, device=device).to(dtype)
    k_pool = torch.randn(N, Hkv, P, D, generator=gen, device=device).to(dtype)
    v_pool = torch.randn(N, Hkv, P, D, generator=gen, device=device).to(dtype)
    table = torch.randperm(N, generator=gen, device=device).to(torch.int32)[None, :]
    return q, dout, k_pool, v_pool, table


def contiguous_kv(pool, table, T):
    """[1, Hkv, T, D]: the table's pages in order (what flex and sdpa read)."""
    return pool[table[0].long()].permute(1, 0, 2, 3).reshape(1, pool.shape[1], -1, pool.shape[3])[:, :, :T]


def run_ours(q, dout, k_pool, v_pool, table, T_past, impl, grads=None):
    out, lse = page_attention_forward(q, k_pool, v_pool, table, first_page=0, q_start=T_past, impl=impl)
    if grads is None:
        return out, lse
    dq = page_attention_backward(q, dout, out, lse, k_pool, v_pool, *grads, table, first_page=0, q_start=T_past,
                                 impl=impl)
    return out, lse, dq


_FLEX = {}


def make_flex(Tq, T, T_past, device):
    """Compiled flex_attention (one compile a process; the offset is a tensor, so a new case does not
    force a new graph) with the chunk's causal block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention)
    offset = torch.tensor(T_past, device=device)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=Tq, KV_LEN=T, device=device)

    def run(q, k, v):
        return _FLEX["fn"](q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    return run


def run_flex(flex, q, dout, k, v, backward=True):
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    out, lse = flex(q, k, v)
    if not backward:
        return out, lse
    out.backward(dout)
    return out, lse, q.grad, k.grad, v.grad


def run_sdpa(q, dout, k, v, T_past, backward=True, assemble=True):
    """Flash over the past keys (no mask) and the chunk's own (causal), merged; backward of each part
    with the merged out and lse, which makes each part's gradient its exact share. assemble: return
    dk, dv per kv head over all keys (for the check; not timed: the engine would keep the parts)."""
    flash, flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention, \
        torch.ops.aten._scaled_dot_product_flash_attention_backward
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    Tq = q.shape[2]
    parts = [(k[:, :, :T_past], v[:, :, :T_past], False), (k[:, :, T_past:T_past + Tq], v[:, :, T_past:], True)]
    results = [flash(q, kp, vp, 0.0, causal) for kp, vp, causal in parts]
    lse = torch.logaddexp(results[0][1], results[1][1])
    out = sum(torch.exp(r[1] - lse)[..., None] * r[0].float() for r in results)
    if not backward:
        return out, lse
    out_b = out.to(q.dtype)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dkv = []
    for (kp, vp, causal), r in zip(parts, results):
        g = flash_bwd(dout, q, kp, vp, out_b, lse, r[2], r[3], r[4], r[5], 0.0, causal, r[6], r[7])
        dq += g[0].float()
        dkv.append((g[1], g[2]))
    if not assemble:
        return out, lse, dq, dkv
    dk = torch.cat([d[0] for d in dkv], dim=2).float()
    dv = torch.cat([d[1] for d in dkv], dim=2).float()
    B, H, T, D = dk.shape
    return (out, lse, dq, dk.reshape(B, H // G, G, T, D).sum(2), dv.reshape(B, H // G, G, T, D).sum(2))


def flops(H, D, Tq, T_past):
    visible = Tq * T_past + Tq * (Tq + 1) / 2  # summed over the chunk's queries
    fwd = 4 * visible * D * H
    return fwd, 3.5 * fwd


def check_reference(device):
    """Ours (bf16) against the torch reference (fp32 math on the same bf16 inputs, small, GQA 7)
    before anything is timed."""
    H, Hkv, D, Tq, T_past, P = 14, 2, 64, 130, 300, 64
    q, dout, k_pool, v_pool, table = make_inputs(H, Hkv, D, Tq, T_past, P, device)
    got, want = [], []
    for impl, out in (("auto", got), ("torch", want)):
        grads = torch.zeros(k_pool.shape, device=device), torch.zeros(k_pool.shape, device=device)
        out.extend([*run_ours(q, dout, k_pool, v_pool, table, T_past, impl, grads), *grads])
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        scale = b.float().abs().max().item()
        check_close(f"ours {name} vs torch reference", a, b, atol=2e-2 * max(scale, 1.0), rtol=2e-2)
    print("check passed: ours against the torch reference", flush=True)


def pool_grads_as_contiguous(grads, table, T):
    return [contiguous_kv(g, table, T) for g in grads]


def run_case(args, results, shape, Tq, T_past, device, timer):
    H, Hkv, D = SHAPES[shape]
    T = T_past + Tq
    q, dout, k_pool, v_pool, table = make_inputs(H, Hkv, D, Tq, T_past, args.page, device)
    grads = torch.zeros(k_pool.shape, device=device), torch.zeros(k_pool.shape, device=device)
    ours = [*run_ours(q, dout, k_pool, v_pool, table, T_past, "auto", grads)]
    ours += pool_grads_as_contiguous(grads, table, T)
    del grads
    fwd_flops, total_flops = flops(H, D, Tq, T_past)
    case = f"{shape}-Tq{Tq}-Tk{T_past}"
    config = dict(H=H, Hkv=Hkv, D=D, Tq=Tq, T_past=T_past, page=args.page, dtype="bf16")
    variants = {"ours": None}
    if device.type == "cuda":
        k, v = contiguous_kv(k_pool, table, T), contiguous_kv(v_pool, table, T)
        try:  # its block mask is built from a dense [Tq, T] bool mask first
            variants["flex"] = (make_flex(Tq, T, T_past, device), k, v)
        except torch.OutOfMemoryError:
            print(f"[{case}] flex: create_block_mask ran out of memory; not timed")
            torch.cuda.empty_cache()
        variants["sdpa"] = (None, k, v)
    rows = []
    for name, extra in variants.items():
        if name == "ours":
            grads = torch.zeros(k_pool.shape, device=device), torch.zeros(k_pool.shape, device=device)
            both = lambda: run_ours(q, dout, k_pool, v_pool, table, T_past, "auto", grads)  # noqa: E731
            fwd = lambda: run_ours(q, dout, k_pool, v_pool, table, T_past, "auto")  # noqa: E731
        else:
            fn, k, v = extra
            try:
                if name == "flex":
                    got = run_flex(fn, q, dout, k, v)
                    both = lambda: run_flex(fn, q, dout, k, v)  # noqa: E731
                    fwd = lambda: run_flex(fn, q, dout, k, v, backward=False)  # noqa: E731
                else:
                    got = run_sdpa(q, dout, k, v, T_past)
                    both = lambda: run_sdpa(q, dout, k, v, T_past, assemble=False)  # noqa: E731
                    fwd = lambda: run_sdpa(q, dout, k, v, T_past, backward=False)  # noqa: E731
                for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ours):
                    scale = b.float().abs().max().item()
                    check_close(f"{name} {label} vs ours", a.float(), b, atol=2e-2 * max(scale, 1.0), rtol=2e-2)
                del got
            except (RuntimeError, AssertionError, AttributeError, TypeError) as err:
                status = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                print(f"{case}/{name}: not timed ({status})", flush=True)
                rows.append(results.add(f"{case}/{name}", {"status": status}, config))
                continue
        try:
            t_both, t_fwd = timer(both), timer(fwd)
        except torch.OutOfMemoryError:
            rows.append(results.add(f"{case}/{name}", {"status": "oom"}, config))
            continue
        figures = dict(t_both.figures(), fwd_ms=t_fwd.median_ms, tflops=tflops(total_flops, t_both.median_ms),
                       fwd_tflops=tflops(fwd_flops, t_fwd.median_ms))
        if device.type == "cuda":
            figures["of_matmul_ceiling"] = figures["tflops"] / ceilings()["matmul_bf16_tflops"]
        rows.append(results.add(f"{case}/{name}", figures, config))
        both = fwd = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_table(rows):
    print("\n| case | variant | fwd+bwd ms | fwd ms | TFLOP/s | of ceiling | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        f = row["figures"]
        case, variant = row["case"].rsplit("/", 1)
        if "status" in f:
            print(f"| {case} | {variant} | {f['status']} | | | | |")
            continue
        ceiling = f"{f['of_matmul_ceiling']:.0%}" if "of_matmul_ceiling" in f else "-"
        print(f"| {case} | {variant} | {f['median_ms']:.2f} | {f['fwd_ms']:.2f} | {f['tflops']:.1f} | {ceiling} | "
              f"{f['peak_gib']:.2f} |")


def csv_ints(text):
    return [int(x) for x in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=lambda s: s.split(","), default=["qwen2-0.5b", "qwen2.5-3b"],
                        help=f"comma-separated head shapes from {sorted(SHAPES)}")
    parser.add_argument("--tq", type=csv_ints, default=[4096, 16384], help="chunk lengths (queries)")
    parser.add_argument("--tk", type=csv_ints, default=[65536, 262144, 1048576], help="past keys before the chunk")
    parser.add_argument("--page", type=int, default=64, help="page size (the engine's --page-tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls a variant (after one warm-up)")
    add_results_arg(parser)
    args = parser.parse_args()
    for shape in args.shapes:
        if shape not in SHAPES:
            parser.error(f"--shapes: unknown shape {shape!r}; pick from {sorted(SHAPES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        timer = lambda fn: time_gpu(fn, warmup=1, repeats=args.repeats)  # noqa: E731
        print(f"ceilings: {ceilings()}", flush=True)
    else:
        timer = lambda fn: time_cpu(fn, warmup=1, repeats=args.repeats)  # noqa: E731
    check_reference(device)
    results, rows = Results(bench="page_attention", path=args.results), []
    for shape in args.shapes:
        for Tq in args.tq:
            for T_past in args.tk:
                rows += run_case(args, results, shape, Tq, T_past, device, timer)
    print_table(rows)


if __name__ == "__main__":
    main()
