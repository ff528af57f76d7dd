"""A whole step planned on any machine from a profiled layer's cost table: bench_offload_gpu.py's
`--predict-layers` prediction (`whole_step`) for budgets other than those the table was measured
under (another card's GPU, another host), and where one fits, its plan saved to run on that machine
as `bench_offload_gpu.py --variants file --plan PLAN --num-layers N`. The timings stay those of the
card that measured the table.

    PYTHONPATH=.:tests/benchmarks python tests/benchmarks/plan_whole_step.py WORK/planned-costs.json \\
        --layers 28 --gpu-memory 139GiB --host-memory 119.9GB --out plan.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_offload_gpu import whole_step

from student.offload.config import parse_bytes
from student.planner.table import CostTable


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("costs", type=Path, help="a planned variant's cost table (bench_offload_gpu.py --work: planned-costs.json)")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers of the whole step")
    parser.add_argument("--gpu-memory", required=True, help="the GPU budget, e.g. 139GiB")
    parser.add_argument("--host-memory", required=True, help="the host budget, e.g. 119.9GB")
    parser.add_argument("--out", type=Path, default=None, help="where to save the plan, when one fits")
    args = parser.parse_args(argv)
    table = CostTable.from_dict(json.loads(args.costs.read_text()))
    figures, plan = whole_step(table, parse_bytes(args.gpu_memory, "gpu_memory"),
                               parse_bytes(args.host_memory, "host_memory"), args.layers)
    print(json.dumps(figures, indent=1))
    if plan is not None and args.out is not None:
        plan.save(args.out)
        print(f"plan saved to {args.out}")
    return figures


if __name__ == "__main__":
    main()
