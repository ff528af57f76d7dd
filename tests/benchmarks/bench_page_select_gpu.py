"""What one sparse chunk's attention costs beside the attention itself, at the seed's lengths: the
page selection and the host gather of the selected pages, as the chunk-recurrent engine runs them
for one layer (student/long_context/store.py), with pages offloaded to pinned host memory.

For each past length (the chunk starts there; every page before it is a candidate), on one layer's
store of the shape's key/value heads:
  select   the selection's score (kernels/page_select.py's `page_mass`) and top --sparse-pages, as
           `select_pages` makes it: the chunk's queries against every past page's mean key, the
           softmax mass per page summed. Its work grows with the past (pass 1 runs it once a chunk
           and layer), unlike the sparse attention's. The torch path, then (CUDA only)
           select_triton: the Triton path, checked against torch first (the masses to 2e-3 relative)
  fetch    the page sets a forward reads: the selected pages gathered on the host (a sync a call)
           and copied to the GPU, and the chunk's own pages
  forward  the chunk's whole sparse attention forward (`_forward`: fetch, page attention, merge)
  keep     pass 1 keeping the chunk's attention output for pass 2 (`_stash`): a new pinned host
           block each call while the earlier ones stay alive, as over a run's first step (later
           steps reuse the blocks torch's pinned allocator keeps); torch's cached pinned blocks are
           given back first. The copy is queued on a side stream; what is timed is what the
           calling thread waits for
Rows `page_select/<shape>-T<chunk>-past<past>/<part>`: median ms; `select` also its TFLOP/s counting
2 x Hkv x T x J x D for the scores (J past pages) and GB/s counting four fp32 passes over the
[Hkv, T, J] scores (written, softmax read and written, summed); `select_triton` its TFLOP/s counting
both its passes (twice the scores' multiply-adds), its largest error and its speedup over `select`.

The GPU run (repo root, about a minute; pinned host memory ~ 2 x 4.3 GB at 4M):

    PYTHONPATH=. python tests/benchmarks/bench_page_select_gpu.py --results tests/benchmarks/results.jsonl

On the CPU (resident pages, tiny):

    PYTHONPATH=. python tests/benchmarks/bench_page_select_gpu.py --shape tiny --chunk-tokens 64 \\
        --past 256,512 --page-tokens 16 --sparse-pages 4 --results tests/benchmarks/out/page_select_cpu.jsonl
"""

from __future__ import annotations

import argparse
import gc

import torch
from harness import Results, add_results_arg, check_close, gbps, tflops, time_cpu, time_gpu

from kernels.page_select import page_mass
from student.long_context.store import PagedKVStore
from student.pinned import release_cached

SHAPES = {"qwen2.5-7b": (28, 4, 128), "tiny": (4, 2, 16)}  # (H, Hkv, D)


def run_case(args, results: Results, past: int, device: torch.device, timer) -> list[dict]:
    H, Hkv, D = SHAPES[args.shape]
    T, P = args.chunk_tokens, args.page_tokens
    store = PagedKVStore(1, 1, past + T, Hkv, D, page_tokens=P, dtype=torch.bfloat16, device=device,
                         offload=device.type == "cuda", sparse_pages=args.sparse_pages, chunk_tokens=T)
    for pool in store.k + store.v:
        pool.zero_()
    J = past // P
    store.mean_k[0][:J].normal_()
    q = torch.randn(1, H, T, D, device=device, dtype=torch.bfloat16)
    store.begin(past, past + T, grad=False)  # the chunk's own pages: the pools' zeros

    def select(impl):
        q_group = q.float().unflatten(1, (Hkv, H // Hkv)).sum(2)  # as select_pages groups them
        return page_mass(q_group, store.mean_k[0][:J], impl=impl).topk(args.sparse_pages, dim=1)

    def fetch():
        for _ in store._page_sets(0, with_grads=False):
            pass

    case, config = f"{args.shape}-T{T}-past{past}", dict(vars(args), past=past, pages=J)
    config.pop("results")
    rows = []
    select_t = timer(lambda: select("torch"))
    rows.append(results.add(f"{case}/select", dict(select_t.figures(),
                                                    tflops=tflops(2 * Hkv * T * J * D, select_t.median_ms),
                                                    gb_s=gbps(4 * 4 * Hkv * T * J, select_t.median_ms)), config))
    if device.type == "cuda":
        error = check_close("select_triton", select("triton").values, select("torch").values, atol=1e-2, rtol=2e-3)
        triton_t = timer(lambda: select("triton"))
        rows.append(results.add(f"{case}/select_triton", dict(
            triton_t.figures(), tflops=tflops(2 * 2 * Hkv * T * J * D, triton_t.median_ms), max_error=error,
            speedup=select_t.median_ms / triton_t.median_ms), config))
    rows.append(results.add(f"{case}/fetch", timer(fetch).figures(), config))
    rows.append(results.add(f"{case}/forward", timer(lambda: store._forward(0, q)).figures(), config))
    out, kept = torch.zeros_like(q), []
    release_cached()  # no block an earlier case freed: each call page-locks a new one
    rows.append(results.add(f"{case}/keep", timer(lambda: kept.append(store._stash(out))).figures(), config))
    del store, kept
    gc.collect()
    return rows


def csv_ints(text):
    return [int(x) for x in text.split(",")]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b", help="head shape (H, Hkv, D)")
    parser.add_argument("--past", type=csv_ints, default=[1048576 - 16384, 2097152 - 16384, 4194304 - 16384],
                        help="past tokens before the chunk (default: the last chunk of 1M, 2M and 4M)")
    parser.add_argument("--chunk-tokens", type=int, default=16384, help="the chunk's queries (the engine's --chunk-tokens)")
    parser.add_argument("--page-tokens", type=int, default=64, help="positions a page (the engine's --page-tokens)")
    parser.add_argument("--sparse-pages", type=int, default=128, help="past pages a chunk attends (--sparse-pages)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls a part (after one warm-up)")
    add_results_arg(parser)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        timer = lambda fn: time_gpu(fn, warmup=1, repeats=args.repeats)  # noqa: E731
    else:
        timer = lambda fn: time_cpu(fn, warmup=1, repeats=args.repeats)  # noqa: E731
    results, rows = Results(bench="page_select", path=args.results), []
    for past in args.past:
        rows += run_case(args, results, past, device, timer)
    print("\n| case | part | ms |\n|---|---|---|")
    for row in rows:
        case, part = row["case"].rsplit("/", 1)
        print(f"| {case} | {part} | {row['figures']['median_ms']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
