"""Host <-> device copy rates as the offload runtime meets them, beside those the planner's profile
measures (issue 18: the cost model's copy rates).

The profile (student/planner/profile.py, `_bandwidths`) copies one 64 MiB buffer from torch's pinned
allocator again and again; the runtime (student/offload/update.py) copies gigabytes of distinct
host memory, page-locked in place (cudaHostRegister), both ways at once in the update's ring. On
the H200 the ring's copies ran slower than the profile's rates both alone and both ways at once
(RESULTS.md, Offloaded training); these cases separate the candidate causes.

Cases `host_copies/<memory>-<span>/<direction>`:
  memory     pinned: torch.empty(pin_memory=True), as the profile; registered: the runtime's own
             host buffers (student.pinned.host_empty)
  span       64MiBx1: one 64 MiB buffer, copied each time (the profile); 1GiBx8: eight distinct
             1 GiB buffers, each copied once in turn (streaming a student's layers)
  direction  h2d, d2h, or both: the same copies each way at once on two side streams
Figures: h2d_gb_s and/or d2h_gb_s, bytes of that direction over the median time of --repeats after
--warmup (CUDA events; for `both`, the pair's time, so each direction's rate while the other runs).

    PYTHONPATH=. python tests/benchmarks/bench_host_copies_gpu.py --results $OUT/results.jsonl
"""

from __future__ import annotations

import argparse

import torch
from harness import Results, add_results_arg, gbps, time_gpu

from student.pinned import host_empty, unpin

BENCH = "host_copies"
SPANS = {"64MiBx1": (64 * 2**20, 1), "1GiBx8": (2**30, 8)}


def host_buffers(memory: str, size: int, count: int) -> list[torch.Tensor]:
    if memory == "pinned":
        return [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    return [host_empty(size, torch.uint8, pin=True) for _ in range(count)]


def copies(direction: str, host_in: list[torch.Tensor], host_out: list[torch.Tensor], dev_in: torch.Tensor,
           dev_out: torch.Tensor, streams: tuple[torch.cuda.Stream, torch.cuda.Stream]):
    """A function copying every host buffer in (h2d), out (d2h) or both at once, each direction
    on its own side stream, the caller's stream waiting for both (so CUDA events on it time them)."""
    ways = {"h2d": [(streams[0], [(dev_in, h) for h in host_in])],
            "d2h": [(streams[1], [(h, dev_out) for h in host_out])]}
    ways["both"] = ways["h2d"] + ways["d2h"]

    def run():
        current = torch.cuda.current_stream()
        for stream, _ in ways[direction]:  # every side stream waits for the caller before any copy is queued,
            stream.wait_stream(current)  # and the caller for all of them after: the two ways overlap
        for stream, pairs in ways[direction]:
            with torch.cuda.stream(stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
        for stream, _ in ways[direction]:
            current.wait_stream(stream)

    return run


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory", default="pinned,registered", help="comma-separated, of pinned, registered")
    parser.add_argument("--spans", default=",".join(SPANS), help=f"comma-separated, of {', '.join(SPANS)}")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    add_results_arg(parser)
    args = parser.parse_args(argv)
    memories, spans = args.memory.split(","), args.spans.split(",")
    if unknown := set(memories) - {"pinned", "registered"}:
        raise SystemExit(f"--memory: unknown {sorted(unknown)}; choose from pinned, registered")
    if unknown := set(spans) - set(SPANS):
        raise SystemExit(f"--spans: unknown {sorted(unknown)}; choose from {', '.join(SPANS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_copies_gpu.py needs a CUDA device (it measures host <-> device copies)")
    results = Results(bench=BENCH, path=args.results)
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    for memory in memories:
        for span in spans:
            size, count = SPANS[span]
            host_in, host_out = host_buffers(memory, size, count), host_buffers(memory, size, count)
            dev_in, dev_out = (torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(2))
            for direction in ("h2d", "d2h", "both"):
                timing = time_gpu(copies(direction, host_in, host_out, dev_in, dev_out, streams),
                                  warmup=args.warmup, repeats=args.repeats)
                figures = {f"{way}_gb_s": gbps(size * count, timing.median_ms)
                           for way in ("h2d", "d2h") if direction in (way, "both")}
                results.add(f"{memory}-{span}/{direction}", {**figures, **timing.figures()},
                            {"memory": memory, "buffer_bytes": size, "buffers": count, "direction": direction,
                             "torch": torch.__version__})
            if memory == "registered":
                for tensor in host_in + host_out:
                    unpin(tensor)
            del host_in, host_out, dev_in, dev_out
            torch.cuda.empty_cache()
    return results.rows


if __name__ == "__main__":
    main()
