"""One decoder layer's forward and backward timed as the planner's profile times it (in bursts, the
device idle in between) and under a sustained load (back to back for --seconds), in one run
(issue 18: the step predictions at 8B and 14B ran 0.79-0.87 of the measured steps, and nvidia-smi
showed the SM clock lower in a step than during the profile; notes/offload.md, "The clock under load").

The layer is built as student/planner/profile.py builds a layer's working copy: the shape's decoder
layer, random init, matrices in bf16 and vectors in fp32, run under bf16 autocast on one sequence
of --seq-len tokens. Three phases, in this order:
  burst      --repeats runs, each its forward and backward timed alone with CUDA events, the host
             synchronising after each and the device then idle for --gap-ms (the profile moves the
             next layer's weights meanwhile)
  sustained  runs back to back for --seconds, nothing synchronising, every run timed: the last
             --repeats are the sustained figure, and the median of the runs that ended within each
             second of device time (`sustained_by_second_ms`) shows how long the load must last
             before the clock settles (the profile's ProfileSettings.load_s)
  hot_burst  burst again, right after the sustained load
  copying    (with --copy-mib) sustained again, while copies of --copy-mib MiB run both ways
             between pinned host memory and the device on two side streams the whole time, as an
             offloaded step's weights, inputs and gradients move beside its layers
Row `layer_clock/<shape>-T<tokens>`: the median milliseconds of each phase, sustained / burst and
hot_burst / burst (and copying / sustained, with the copies' rates each way while the layer ran).
A sustained / burst above 1 is what a profile timing in bursts misses of a step; copying /
sustained above 1 what the profile's cost model misses by letting copies not slow compute
(student/planner/costs.py's predict).

    PYTHONPATH=. python tests/benchmarks/bench_layer_clock_gpu.py --shape llama-3.1-8b --results $OUT/results.jsonl
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_offload_gpu import shape_config
from harness import Results, add_results_arg

from student.model import Student
from student.planner.profile import burst_seconds, layer_run, loaded_seconds

BENCH = "layer_clock"


def working_layer(shape: str, seq_len: int, device: str, seed: int):
    """`run()`: one layer of `shape` as the profile's working copy (student.planner.profile.layer_run),
    its forward and backward on one sequence of `seq_len` tokens."""
    torch.manual_seed(seed)
    model = Student(shape_config(shape, seq_len).replace(num_layers=1))
    return layer_run(model, (1, seq_len), torch.bfloat16, device)


def by_second(run_ms: list[float]) -> list[float]:
    """The median milliseconds of the runs that ended within each whole second of the runs' summed
    time (back to back, the device's time), in order; a last partial second is left out."""
    seconds, ended = [], 0.0
    for ms in run_ms:
        ended += ms
        second = int(ended // 1e3)
        seconds.extend([] for _ in range(second + 1 - len(seconds)))
        seconds[second].append(ms)
    return [statistics.median(runs) for runs in seconds[:-1] if runs]


def copying_seconds(run, seconds: float, repeats: int, copy_bytes: int, device: str) -> tuple[list[float], float, float]:
    """loaded_seconds of `run` while copies of `copy_bytes` go host->device and device->host on two
    side streams, queued for longer than the runs take: (the runs' seconds, the bytes per second
    each way over the copies that ended before the last run did)."""
    host_in, host_out = (torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev_in, dev_out = (torch.empty(copy_bytes, dtype=torch.uint8, device=device) for _ in range(2))
    streams = torch.cuda.Stream(device), torch.cuda.Stream(device)
    count = int(seconds * 60e9 / copy_bytes) + 4  # more than the bus moves meanwhile
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    ends = ([], [])
    for _ in range(count):
        for stream, done, (dst, src) in zip(streams, ends, ((dev_in, host_in), (host_out, dev_out))):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                done.append(event)
    runs = loaded_seconds(run, seconds, repeats, device)
    last = torch.cuda.Event(enable_timing=True)
    last.record()
    torch.cuda.synchronize(device)
    until = start.elapsed_time(last) / 1e3
    rates = []
    for done in ends:
        times = [start.elapsed_time(e) / 1e3 for e in done]
        n = sum(t <= until for t in times)
        rates.append(n * copy_bytes / max(t for t in times if t <= until) if n else 0.0)
    return runs, rates[0], rates[1]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b",
                        choices=("llama-3.1-8b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-3b", "qwen2-0.5b", "tiny"))
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of the sustained phase")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gap-ms", type=float, default=200.0, help="device idle time after each burst run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--copy-mib", type=int, default=0, help="MiB of each copy in the copying phase (0: no copying phase)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    add_results_arg(parser)
    args = parser.parse_args(argv)
    if args.copy_mib and args.device != "cuda":
        parser.error("--copy-mib copies between pinned host memory and a GPU: use it with --device cuda")
    run = working_layer(args.shape, args.seq_len, args.device, args.seed)
    run()  # kernels chosen and compiled, outside every phase
    ms = lambda seconds: [t * 1e3 for t in seconds]
    burst = ms(burst_seconds(run, args.repeats, args.gap_ms / 1e3, args.device))
    every = ms(loaded_seconds(run, args.seconds, args.repeats, args.device))
    sustained, runs = every[-args.repeats:], len(every)
    hot = ms(burst_seconds(run, args.repeats, args.gap_ms / 1e3, args.device))
    med = statistics.median
    figures = {"burst_ms": med(burst), "sustained_ms": med(sustained), "hot_burst_ms": med(hot),
               "sustained_over_burst": med(sustained) / med(burst), "hot_burst_over_burst": med(hot) / med(burst),
               "sustained_runs": runs, "burst_all_ms": burst, "sustained_last_ms": sustained, "hot_burst_all_ms": hot,
               "sustained_by_second_ms": by_second(every)}
    if args.copy_mib:
        runs_s, h2d, d2h = copying_seconds(run, args.seconds, args.repeats, args.copy_mib * 2**20, args.device)
        copying = ms(runs_s)[-args.repeats:]
        figures.update(copying_ms=med(copying), copying_over_sustained=med(copying) / med(sustained),
                       copying_last_ms=copying, copying_h2d_gb_s=h2d / 1e9, copying_d2h_gb_s=d2h / 1e9)
    results = Results(bench=BENCH, path=args.results)
    results.add(f"{args.shape}-T{args.seq_len}", figures,
                {"shape": args.shape, "seq_len": args.seq_len, "seconds": args.seconds, "repeats": args.repeats,
                 "gap_ms": args.gap_ms, "copy_mib": args.copy_mib, "torch": torch.__version__})
    return results.rows


if __name__ == "__main__":
    main()
