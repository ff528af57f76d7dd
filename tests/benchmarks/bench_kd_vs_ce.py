"""Quality on real data: the same student, same steps, trained from the teacher cache (KD) or on
cross-entropy alone (the cached text's next tokens, no teacher). Held-out KL to the teacher and
held-out cross-entropy, with a plot of both curves.

    python tests/benchmarks/bench_kd_vs_ce.py                                  # CPU, the recipe's sizes
    python tests/benchmarks/bench_kd_vs_ce.py --cache caches/quickstart --steps 120 --eval-every 20

Builds the cache of pipelines/recipes/quickstart.toml first unless --cache names one. Writes
OUT/kd/, OUT/ce/ (run dirs), OUT/kd_vs_ce.json and OUT/kd_vs_ce.png (OUT defaults to
tests/benchmarks/out/kd_vs_ce, which git ignores), and the rows `kd_vs_ce/kd` and `kd_vs_ce/ce`:
held-out KL, CE and top-1 at the last evaluation, the KL curve and the teacher's own held-out CE.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from run_helpers import add_variant_run_args, load_bench_recipe, run_variants

RUNS = {"kd": (0.0, "KD from the cache (ce_weight=0)"), "ce": (1.0, "cross-entropy only (ce_weight=1)")}


def plot(results: dict, path: Path) -> None:
    """Held-out KL and CE against step for both runs (log scale: the first evaluation is far above)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for run in results["runs"].values():
        steps = [r["step"] for r in run["eval"]]
        axes[0].plot(steps, [r["kl"] for r in run["eval"]], marker="o", label=run["label"])
        axes[1].plot(steps, [r["ce"] for r in run["eval"]], marker="o", label=run["label"])
    axes[0].set(xlabel="step", ylabel="held-out KL to teacher (nats/token)", title="KL to the teacher", yscale="log")
    axes[1].set(xlabel="step", ylabel="held-out cross-entropy (nats/token)", title="Cross-entropy on the text",
                yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse(spec: str) -> tuple[str, dict]:
    if spec not in RUNS:
        raise SystemExit(f"variant must be one of {', '.join(RUNS)}, got {spec!r}")
    return spec, {"ce_weight": RUNS[spec][0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_run_args(ap, variants="kd,ce", eval_every=None, results_json="kd_vs_ce.json", cache_required=False)
    args = ap.parse_args()
    if args.replot:
        plot(json.loads((args.out / "kd_vs_ce.json").read_text()), args.out / "kd_vs_ce.png")
        return
    if args.cache is None:
        from pipelines.stage_one import cache_teacher

        cache_teacher(load_bench_recipe(args.recipe).stage_one)

    def describe(spec, config, run_dir):
        return {"label": RUNS[spec][1]}, ""

    results = run_variants(args, parse, describe, "kd_vs_ce.json", bench="kd_vs_ce")
    plot(results, args.out / "kd_vs_ce.png")


if __name__ == "__main__":
    main()
