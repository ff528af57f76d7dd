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
  sustained  runs back to back for --seconds, nothing synchronising, every run timed: the last
             --repeats are the sustained figure, and the median of the runs that ended within each
             second of device time (`sustained_by_second_ms`) shows how long the load must last
             before the clock settles (the profile's ProfileSettings.load_s)
  hot_burst  burst again, right after the sustained load
Row `layer_clock/<shape>-T<tokens>`: the median milliseconds of each phase, sustained / burst and
hot_burst / burst. A sustained / burst above 1 is what a profile timing in bursts misses of a step.

    PYTHONPATH=. python tests/benchmarks/bench_layer_clock_gpu.py --shape llama-3.1-8b --results $OUT/results.jsonl
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_offload_gpu import shape_config
from harness import Results, add_results_arg

from student.model import Student
from student.step_profile import burst_seconds, layer_run, loaded_seconds

BENCH = "layer_clock"


def working_layer(shape: str, seq_len: int, device: str, seed: int):
    """`run()`: one layer of `shape` as the profile's working copy (student.step_profile.layer_run),
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
    results = Results(bench=BENCH, path=args.results)
    results.add(f"{args.shape}-T{args.seq_len}", figures,
                {"shape": args.shape, "seq_len": args.seq_len, "seconds": args.seconds, "repeats": args.repeats,
                 "gap_ms": args.gap_ms, "torch": torch.__version__})
    return results.rows


if __name__ == "__main__":
    main()
