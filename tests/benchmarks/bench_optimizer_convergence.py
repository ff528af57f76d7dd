"""Convergence on real data: the same student, data and steps with AdamW, FOAM and 8-bit AdamW;
held-out KL to the teacher against step, in one plot.

    python tests/benchmarks/bench_optimizer_convergence.py --cache caches/quickstart --out /tmp/optim_conv
    python tests/benchmarks/bench_optimizer_convergence.py --cache caches/quickstart --out /tmp/optim_conv \
        --variants adamw,foam:2,foam:2:lr=2e-3,adamw8bit --steps 120 --eval-every 20

Variants: "adamw", "adamw8bit", "foam:LEVEL", each optionally with ":lr=VALUE" (default: the
recipe's lr). Uses pipelines/recipes/quickstart.toml's student and [train] settings unless --recipe
names another. Writes OUT/NAME/ run dirs, OUT/convergence.json and OUT/convergence.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from run_helpers import add_variant_run_args, metric_rows, parse_optimizer_variant, run_variants


def state_bytes(run_dir: Path) -> int | None:
    return next((r["optimizer_state_bytes"] for r in reversed(metric_rows(run_dir)) if "optimizer_state_bytes" in r),
                None)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r in results["runs"].items():
        rows = r["eval"]
        ax.plot([x["step"] for x in rows], [x["kl"] for x in rows], marker="o", label=r["label"])
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
        return {"label": f"{spec} (lr {config.lr:g})", "optimizer_state_bytes": state}, f" state {state:,} B"

    results = run_variants(args, parse_optimizer_variant, describe, "convergence.json")
    plot(results, args.out / "convergence.png")


if __name__ == "__main__":
    main()
