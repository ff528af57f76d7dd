"""The TwELL pack step alone on one gate chunk (kernels/twell_ffn.py `_pack`: per-tile counts,
on-device running sums, scatter into the ELL / backup lists, or only the words' list positions as
the path by blocks takes it) against what the same bytes cost in plain torch: the
compare-and-count, torch.nonzero_static (CUB select, no host sync), a copy and a sum (one read);
and the count pass alone at other block sizes.

Chunk: the forward's default chunk at dff 5632 (23,831 rows), bf16, per-row counts lognormal
(sigma 0.8) with mean (1 - sparsity) * dff, as in bench_twell_ffn_gpu.py. Times: CUDA events
through triton.testing.do_bench, median.

    PYTHONPATH=. python tests/benchmarks/bench_twell_pack_gpu.py [--out pack.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

import kernels.twell_ffn as twell


def gate_chunk(rows, d_ff, sparsity, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g = torch.randn(rows, d_ff, device="cuda", generator=gen)
    raw = torch.exp(0.8 * torch.randn(rows, device="cuda", generator=gen, dtype=torch.float64))
    counts = (raw / raw.mean() * (1.0 - sparsity) * d_ff).round().clamp(0, d_ff).long()
    desc = torch.sort(g, dim=1, descending=True).values
    padded = torch.cat([desc[:, :1] + 1.0, desc, desc[:, -1:] - 1.0], dim=1)
    thr = 0.5 * (padded.gather(1, counts[:, None]) + padded.gather(1, counts[:, None] + 1))
    return (g - thr).to(torch.bfloat16)


def pack_buffers(rows, d_ff, width=128):
    cap = -(-rows // 8)
    i32 = dict(dtype=torch.int32, device="cuda")
    tiles = triton.cdiv(d_ff, twell._TILE_F)
    return dict(count=torch.empty(rows, **i32), slot=torch.empty(rows, **i32),
                start=torch.empty(tiles + 1, rows, **i32), ell_idx=torch.empty(rows, width, **i32),
                ell_hg=torch.empty(rows, width, dtype=torch.bfloat16, device="cuda"),
                bk_idx=torch.empty(cap, d_ff - width, **i32),
                bk_hg=torch.empty(cap, d_ff - width, dtype=torch.bfloat16, device="cuda"),
                counter=torch.zeros(1, **i32), active=torch.zeros(d_ff, **i32), cap=cap,
                words=torch.empty(rows, tiles * twell._TILE_F // 32, **i32),
                wpos=torch.empty(rows, tiles * twell._TILE_F // 32, **i32))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=(1 << 27) // 5632)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "rows": args.rows, "d_ff": args.d_ff, "runs": []}
    bench = lambda fn: triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median")  # noqa: E731
    for sparsity in (0.99, 0.995):
        g = gate_chunk(args.rows, args.d_ff, sparsity)
        b = pack_buffers(args.rows, args.d_ff)

        def pack(lists=True):
            b["counter"].zero_()
            twell._pack(g, b["words"], b["wpos"], 0, b["count"], b["slot"], b["start"], b["ell_idx"], b["ell_hg"],
                        b["bk_idx"], b["bk_hg"], b["counter"], b["active"], b["cap"], lists)

        def count_only(block_m=twell._COUNT_BLOCK_M, rows=twell._PACK_ROWS, warps=twell._PACK_WARPS):
            grid = (b["start"].shape[0] - 1, triton.cdiv(args.rows, rows))
            twell._count_kernel[grid](g, b["start"][1:], b["words"], b["active"], 0, args.rows, args.rows, args.d_ff,
                                      b["words"].shape[1], BLOCK_M=block_m, ROW_BLOCKS=rows // block_m,
                                      TILE_F=twell._TILE_F, num_warps=warps)

        pack()  # check the lists against torch once
        nz = torch.nonzero(g > 0)
        counts = (g > 0).sum(1)
        assert torch.equal(b["count"].long(), counts), "pack counts differ from torch"
        first = torch.zeros(args.rows + 1, dtype=torch.long, device="cuda")
        first[1:] = counts.cumsum(0)
        pos = torch.arange(nz.shape[0], device="cuda") - first[nz[:, 0]]
        in_ell = pos < 128
        assert torch.equal(b["ell_idx"][nz[in_ell, 0], pos[in_ell]].long(), nz[in_ell, 1]), "ELL columns differ"
        rec = {"sparsity": sparsity, "gate_bytes": g.numel() * 2}
        rec["pack_ms"] = bench(pack)
        rec["pack_without_lists_ms"] = bench(lambda: pack(lists=False))
        rec["count_kernel_ms"] = bench(count_only)
        for block_m, rows, warps in ((16, 256, 4), (64, 256, 4), (32, 128, 4), (32, 512, 4), (32, 256, 2),
                                     (32, 256, 8), (64, 512, 8)):
            rec[f"count_kernel_bm{block_m}_rows{rows}_warps{warps}_ms"] = bench(lambda: count_only(block_m, rows, warps))
        rec["torch_sum_ms"] = bench(lambda: g.sum(dtype=torch.float32))  # reads the chunk once
        for bm in (32, 128):
            old = twell._SCATTER_BLOCK_M
            twell._SCATTER_BLOCK_M = bm
            rec[f"pack_scatter_bm{bm}_ms"] = bench(pack)
            twell._SCATTER_BLOCK_M = old
        rec["torch_count_ms"] = bench(lambda: (g > 0).sum(1))
        size = args.rows * 128
        rec["torch_nonzero_static_ms"] = bench(lambda: torch.nonzero_static(g > 0, size=size, fill_value=-1))
        rec["torch_nonzero_sync_ms"] = bench(lambda: torch.nonzero(g > 0))
        dst = torch.empty_like(g)
        rec["copy_ms"] = bench(lambda: dst.copy_(g))
        result["runs"].append(rec)
        print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
