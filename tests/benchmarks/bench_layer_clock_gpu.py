"""One decoder layer's forward and backward timed as the planner's profile times it (in bursts, the
device idle in between) and under a sustained load (back to back for --seconds), in one run
(issue 18: the step predictions at 8B and 14B ran 0.79-0.87 of the measured steps, and nvidia-smi
showed the SM clock lower in a step than during the profile; LOG.md, twelfth session).

The layer is built as student/step_profile.py builds a layer's working copy: the shape's decoder
layer, random init, matrices in bf16 and vectors in fp32, run under bf16 autocast on one sequence
of --seq-len tokens. Three phases, in this order:
  burst      --repeats runs, each its forward and backward timed alone with CUDA events, the host
             synchronising after each and the device then idle for --gap-ms (the profile moves the
             next layer's weights meanwhile)
  sustained  runs back to back for --seconds, nothing synchronising; the last --repeats runs timed
  hot_burst  burst again, right after the sustained load
Row `layer_clock/<shape>-T<tokens>`: the median milliseconds of each phase, sustained / burst and
hot_burst / burst. A sustained / burst above 1 is what a profile timing in bursts misses of a step.

    PYTHONPATH=. python tests/benchmarks/bench_layer_clock_gpu.py --shape llama-3.1-8b --results $OUT/results.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_offload_gpu import shape_config
from harness import Results, add_results_arg

from student.model import Student, rope_cos_sin

BENCH = "layer_clock"


def working_layer(shape: str, seq_len: int, device: str, seed: int):
    """(run, x): one layer of `shape` as the profile's working copy, and `run()` doing its forward
    and backward on a fresh leaf of x."""
    torch.manual_seed(seed)
    config = shape_config(shape, seq_len).replace(num_layers=1)
    model = Student(config)
    layer = model.layers[0].to(device)
    for p in layer.parameters():
        if p.ndim >= 2:
            p.data = p.data.to(torch.bfloat16)
    x = torch.randn(1, seq_len, config.hidden_size, device=device, dtype=torch.bfloat16)
    positions = torch.arange(seq_len, device=device)[None]
    cos, sin = rope_cos_sin(model.inv_freq.to(device), positions, torch.bfloat16)

    def run():
        leaf = x.detach().requires_grad_(True)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            out, _ = layer(leaf, cos, sin)
        out.backward(torch.ones_like(out))
        layer.zero_grad(set_to_none=True)

    return run


def burst_ms(run, repeats: int, gap_s: float, cuda: bool) -> list[float]:
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
        time.sleep(gap_s)
    return times


def sustained_ms(run, seconds: float, repeats: int, cuda: bool) -> tuple[list[float], int]:
    """(the last `repeats` runs' milliseconds, runs in all) of runs back to back for `seconds`."""
    events, runs, t0 = [], 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or runs < repeats:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            events = (events + [(start, end)])[-repeats:]
        else:
            s = time.perf_counter()
            run()
            events = (events + [(time.perf_counter() - s) * 1e3])[-repeats:]
        runs += 1
    if cuda:
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events], runs
    return events, runs


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b",
                        choices=("llama-3.1-8b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-3b", "qwen2-0.5b", "tiny"))
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of the sustained phase")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gap-ms", type=float, default=200.0, help="device idle time after each burst run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    add_results_arg(parser)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    run = working_layer(args.shape, args.seq_len, args.device, args.seed)
    run()  # kernels chosen and compiled, outside every phase
    burst = burst_ms(run, args.repeats, args.gap_ms / 1e3, cuda)
    sustained, runs = sustained_ms(run, args.seconds, args.repeats, cuda)
    hot = burst_ms(run, args.repeats, args.gap_ms / 1e3, cuda)
    med = statistics.median
    figures = {"burst_ms": med(burst), "sustained_ms": med(sustained), "hot_burst_ms": med(hot),
               "sustained_over_burst": med(sustained) / med(burst), "hot_burst_over_burst": med(hot) / med(burst),
               "sustained_runs": runs, "burst_all_ms": burst, "sustained_last_ms": sustained, "hot_burst_all_ms": hot}
    results = Results(bench=BENCH, path=args.results)
    results.add(f"{args.shape}-T{args.seq_len}", figures,
                {"shape": args.shape, "seq_len": args.seq_len, "seconds": args.seconds, "repeats": args.repeats,
                 "gap_ms": args.gap_ms, "torch": torch.__version__})
    return results.rows


if __name__ == "__main__":
    main()
