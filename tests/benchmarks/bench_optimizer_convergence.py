"""Convergence on real data, on a CPU: the same student, data and steps with AdamW, FOAM and 8-bit
AdamW; held-out KL to the teacher against step, in one plot.

    PYTHONPATH=$PWD python tests/benchmarks/bench_optimizer_convergence.py --cache caches/quickstart \
        --variants adamw,foam:2,foam:4,adamw8bit --eval-every 20 --results $OUT/results.jsonl
    # FOAM at 4x the learning rate, in another folder
    PYTHONPATH=$PWD python tests/benchmarks/bench_optimizer_convergence.py --cache caches/quickstart \
        --variants foam:2:lr=4e-3,foam:4:lr=4e-3 --eval-every 20 --out tests/benchmarks/out/convergence_lr4e-3

Variants: "adamw", "adamw8bit", "foam:LEVEL", each optionally with ":lr=VALUE" (default: the
recipe's lr). The student and the [train] settings are pipelines/recipes/quickstart.toml's unless
--recipe names another; --cache must hold that recipe's teacher cache. Writes OUT/NAME/ run dirs,
OUT/convergence.json and OUT/convergence.png (OUT defaults to tests/benchmarks/out/convergence,
which git ignores) and one results row a run, `optimizer_convergence/NAME`: the last held-out KL,
CE and top-1, the KL at every evaluation and the optimizer state.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from run_helpers import add_variant_run_args, metric_rows, parse_optimizer_variant, run_variants


def state_bytes(run_dir: Path) -> int | None:
    return next((r["optimizer_state_bytes"] for r in reversed(metric_rows(run_dir, "train"))
                 if "optimizer_state_bytes" in r), None)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for run in results["runs"].values():
        rows = run["eval"]
        ax.plot([x["step"] for x in rows], [x["kl"] for x in rows], marker="o", label=run["label"])
    ax.set(xlabel="step", ylabel="held-out KL to teacher (nats/token)", yscale="log",
           title="Optimizers on the same distillation run")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_run_args(ap, variants="adamw,foam:2,adamw8bit", eval_every=None, results_json="convergence.json")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads((args.out / "convergence.json").read_text()), args.out / "convergence.png")
        return

    def describe(spec, config, run_dir):
        state = state_bytes(run_dir)
        fields = {"label": f"{spec} (lr {config.to_flat()['lr']:g})",
                  "optimizer_state_mib": None if state is None else state / 2**20}
        return fields, f" state {state:,} B" if state is not None else ""

    results = run_variants(args, parse_optimizer_variant, describe, "convergence.json", bench="optimizer_convergence")
    plot(results, args.out / "convergence.png")


if __name__ == "__main__":
    main()
