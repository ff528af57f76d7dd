"""Convergence on real data, on a CPU: the same student, data and steps with AdamW, FOAM and 8-bit
AdamW; held-out KL to the teacher against step, in one plot.

    PYTHONPATH=$PWD python tests/benchmarks/bench_optimizer_convergence.py --cache caches/quickstart \
        --variants adamw,foam:2,foam:4,adamw8bit --eval-every 20 --results $OUT/results.jsonl
    # FOAM at 4x the learning rate, and the plot again from the rows of a results file
    PYTHONPATH=$PWD python tests/benchmarks/bench_optimizer_convergence.py --cache caches/quickstart \
        --variants foam:2:lr=4e-3,foam:4:lr=4e-3 --eval-every 20
    PYTHONPATH=$PWD python tests/benchmarks/bench_optimizer_convergence.py --replot

Variants: "adamw", "adamw8bit", "foam:LEVEL", each optionally with ":lr=VALUE" (default: the
recipe's lr). The student and the [train] settings are pipelines/recipes/quickstart.toml's unless
--recipe names another; --cache must hold that recipe's teacher cache. Each variant trains in
RUNS/NAME (default under tests/benchmarks/out/) and adds one row (bench "optimizer_convergence",
case NAME: the last held-out KL, CE and top-1, the KL at every evaluation, the optimizer state);
the plot (tests/benchmarks/out/optimizer_convergence.png) is drawn from the newest row of each case
in the results file.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from harness import OUTPUT_DIR, Results, add_results_arg, load_rows
from run_helpers import metric_rows, parse_optimizer_variant

BENCH = "optimizer_convergence"


def plot(rows: list[dict], path: Path) -> None:
    """Held-out KL against step, one line per case (its newest row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    newest = {row["case"]: row for row in rows}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for case, row in newest.items():
        figures = row["figures"]
        label = f"{case} (lr {row['config']['lr']:g})"
        ax.plot(figures["steps"], figures["heldout_kl_by_step"], marker="o", label=label)
    ax.set(xlabel="step", ylabel="held-out KL to teacher (nats/token)", yscale="log",
           title="Optimizers on the same distillation run")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def base_config(args):
    """The recipe's TrainConfig on --cache, with --steps / --eval-every when given."""
    from pipelines.defaults import default_teacher_dir
    from pipelines.recipe import builtin_recipe, load_recipe, train_config

    recipe = load_recipe(args.recipe or builtin_recipe("quickstart"))
    base = train_config(recipe, recipe.stage_one.teacher.model or default_teacher_dir())
    overrides = {"cache": str(args.cache), "steps": args.steps, "eval_every": args.eval_every}
    return base.with_flat(**{k: v for k, v in overrides.items() if v is not None})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, help="a complete cache of the recipe's teacher")
    ap.add_argument("--recipe", type=Path, default=None, help="default: the built-in quickstart")
    ap.add_argument("--variants", default="adamw,foam:2,adamw8bit")
    ap.add_argument("--steps", type=int, default=None, help="override the recipe's steps")
    ap.add_argument("--eval-every", type=int, default=None, help="override the recipe's eval_every")
    ap.add_argument("--runs", type=Path, default=OUTPUT_DIR / "optimizer_convergence_runs", help="run directories")
    ap.add_argument("--png", type=Path, default=OUTPUT_DIR / "optimizer_convergence.png")
    ap.add_argument("--replot", action="store_true", help="only draw --png from the rows in --results")
    add_results_arg(ap)
    args = ap.parse_args()
    if args.replot:
        plot([row for row in load_rows(args.results) if row["bench"] == BENCH], args.png)
        return
    if args.cache is None:
        ap.error("--cache is required (unless --replot)")

    from student.trainer import train

    base = base_config(args)
    results = Results(bench=BENCH, path=args.results)
    rows = []
    for spec in args.variants.split(","):
        name, overrides = parse_optimizer_variant(spec)
        config = base.with_flat(out=str(args.runs / name), **overrides)
        start = time.perf_counter()
        train(config)
        seconds = time.perf_counter() - start
        evals = metric_rows(args.runs / name, "eval")
        state = next((r["optimizer_state_bytes"] for r in reversed(metric_rows(args.runs / name, "train"))
                      if "optimizer_state_bytes" in r), None)
        last = evals[-1]
        figures = {"heldout_kl": last["kl"], "heldout_ce": last["ce"], "heldout_top1": last["top1"],
                   "optimizer_state_mib": state / 2**20 if state is not None else None,
                   "steps": [r["step"] for r in evals], "heldout_kl_by_step": [r["kl"] for r in evals],
                   "seconds": seconds}
        rows.append(results.add(name, figures, {**config.to_flat(), "variant": spec}))
    plot(rows, args.png)


if __name__ == "__main__":
    main()
