"""Tune the fused KL's row kernel (block width, warps) on a GPU, then time the whole loss with the
best setting beside the default, the bare matmuls and Liger, at the issue's six shapes.

    python3 tests/benchmarks/tune_fused_kl_row_gpu.py --out $OUT/tune.json

The row pass (the "scaled" row kernel) reads a chunk's [C, V] logits once and writes them once;
its speed is reported as those 2 C V element-bytes over its time, beside the device's copy
bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_fused_kl_gpu as bench  # noqa: E402

import kernels.fused_topk_kl as fk  # noqa: E402
import kernels.fused_topk_kl_triton as fkt  # noqa: E402


def time_row_pass(z0, h, ids, lp, tail_lp, kl_w, ce_w, repeats=20):
    z = torch.empty_like(z0)
    loss = torch.empty(z0.shape[0], device="cuda")
    sigma, hs = torch.empty_like(loss), torch.empty_like(h)
    times = []
    for i in range(repeats + 3):
        z.copy_(z0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        assert fkt._row_pass(z, ids, lp, tail_lp, None, kl_w, ce_w, loss, h, sigma, hs, "bucket", 1.0, True)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times), z, loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--blocks", default="2048,4096,8192,16384")
    ap.add_argument("--warps", default="4,8,16,32")
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "copy_GBps": bench.copy_bandwidth() / 1e9, "sweep": []}
    default = (fkt._SCALED_BLOCK, fkt._SCALED_WARPS)
    best = {}
    for v, c in ((49152, 8192), (151936, 2048)):
        hidden, weight, ids, lp, tl, _, _ = bench.make_inputs(c, v, 2048, 100, torch.bfloat16)
        logp, logp_tail = fk._teacher_logprobs(lp.float(), tl.float(), "bucket", 1.0)
        kl_w = torch.full((c,), 1.0 / c, device="cuda")
        z0 = hidden @ weight.T
        ref = None
        for block, warps in itertools.product(map(int, args.blocks.split(",")), map(int, args.warps.split(","))):
            fkt._SCALED_BLOCK, fkt._SCALED_WARPS = block, warps
            ms, z, loss = time_row_pass(z0, hidden, ids, logp.contiguous(), logp_tail, kl_w, kl_w)
            if ref is None:
                ref = (z.float(), loss.clone())
            err = ((z.float() - ref[0]).norm() / ref[0].norm()).item()
            gbps = 2 * z0.numel() * z0.element_size() / (ms * 1e-3) / 1e9
            row = dict(V=v, C=c, block=block, warps=warps, ms=ms, GBps=gbps, grad_rel_diff=err,
                       loss_rel_diff=((loss - ref[1]).abs().sum() / ref[1].abs().sum()).item())
            report["sweep"].append(row)
            print(f"V={v} C={c} block={block} warps={warps}: {ms:.3f} ms {gbps:.0f} GB/s diff {err:.1e}", flush=True)
        rows = [r for r in report["sweep"] if r["V"] == v]
        best[v] = min(rows, key=lambda r: r["ms"])
        print(f"best at V={v}: {best[v]}; default {default}: "
              f"{[r['ms'] for r in rows if (r['block'], r['warps']) == default]}", flush=True)
        del hidden, weight, z0
        torch.cuda.empty_cache()
    fkt._SCALED_BLOCK, fkt._SCALED_WARPS = default

    # The whole loss at the shapes: default vs each V's best setting, bare, Liger.
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    report["loss"] = []
    for v in (49152, 151936):
        for n in (8192, 32768, 131072):
            hidden, weight, ids, lp, tl, target, _ = bench.make_inputs(n, v, 2048, 100, torch.bfloat16)
            h = hidden.detach().clone().requires_grad_()
            w = weight.detach().clone().requires_grad_()

            def ours(block, warps):
                def step():
                    fkt._SCALED_BLOCK, fkt._SCALED_WARPS = block, warps
                    loss = fk.fused_topk_kl(h, w, ids, lp, tl, tail="unnormalized", impl="triton", check_ids=False)
                    loss.backward()
                    return loss.detach()
                return step

            def liger():
                loss = LigerFusedLinearCrossEntropyLoss()(w, h, target)
                loss.backward()
                return loss.detach()

            out = {"V": v, "N": n}
            out["bare"] = bench.bare_matmuls(hidden, weight, 2, 5)[0]
            for name, step in (("default", ours(*default)), ("best", ours(best[v]["block"], best[v]["warps"])),
                               ("liger", liger)):
                ms, extra, _ = bench.measure(step, [h, w], 2, 5)
                out[name], out[name + "_extra_GiB"] = ms, extra / 2**30
            fkt._SCALED_BLOCK, fkt._SCALED_WARPS = default
            report["loss"].append(out)
            print(f"V={v} N={n}: bare {out['bare']:.1f} default {out['default']:.1f} ({out['default'] / out['bare']:.3f}x) "
                  f"best {out['best']:.1f} ({out['best'] / out['bare']:.3f}x) liger {out['liger']:.1f} "
                  f"({out['liger'] / out['bare']:.3f}x)", flush=True)
            del hidden, weight, h, w
            torch.cuda.empty_cache()
    report["best"] = {str(v): b for v, b in best.items()}
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
