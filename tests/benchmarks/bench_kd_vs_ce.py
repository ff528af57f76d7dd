"""Quality on real data: the same student, same steps, trained from the teacher cache (KD) or on
cross-entropy alone (the cached text's next tokens, no teacher). Held-out KL to the teacher and
held-out cross-entropy, with a plot of both curves.

    python tests/benchmarks/bench_kd_vs_ce.py --out /tmp/kd_vs_ce            # CPU, default recipe sizes
    python tests/benchmarks/bench_kd_vs_ce.py --cache caches/quickstart --steps 300 --out /tmp/kd_vs_ce

Builds the cache of pipelines/recipes/quickstart.toml first unless --cache names one. Writes
OUT/kd/, OUT/ce/ (run dirs), OUT/kd_vs_ce.json and OUT/kd_vs_ce.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from run_helpers import load_bench_recipe, metric_rows, recipe_train_config


def plot(results: dict, path: Path) -> None:
    """Held-out KL and CE against step for both runs (log scale: the first evaluation is far above)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, label in (("kd", "KD from the cache (ce_weight=0)"), ("ce", "cross-entropy only (ce_weight=1)")):
        rows = results[name]["eval"]
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["kl"] for r in rows], marker="o", label=label)
        axes[1].plot(steps, [r["ce"] for r in rows], marker="o", label=label)
    axes[0].set(xlabel="step", ylabel="held-out KL to teacher (nats/token)", title="KL to the teacher", yscale="log")
    axes[1].set(xlabel="step", ylabel="held-out cross-entropy (nats/token)", title="Cross-entropy on the text",
                yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache", type=Path, default=None, help="existing cache (default: build the quickstart's)")
    ap.add_argument("--recipe", type=Path, default=None, help="recipe whose cache and [train] settings are used")
    ap.add_argument("--steps", type=int, default=None, help="override [train] steps")
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--replot", action="store_true", help="only redraw OUT/kd_vs_ce.png from OUT/kd_vs_ce.json")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads((args.out / "kd_vs_ce.json").read_text()), args.out / "kd_vs_ce.png")
        return

    from pipelines.stage_one import cache_teacher
    from student.trainer import train

    recipe = load_bench_recipe(args.recipe, args.cache)
    if args.cache is None:
        cache_teacher(recipe.stage_one)
    base = recipe_train_config(recipe, args.steps, args.eval_every)
    results = {}
    for name, ce_weight in (("kd", 0.0), ("ce", 1.0)):
        config = dataclasses.replace(base, out=args.out / name, ce_weight=ce_weight)
        start = time.perf_counter()
        train(config)
        results[name] = {"ce_weight": ce_weight, "seconds": time.perf_counter() - start,
                         "eval": metric_rows(args.out / name, "eval")}
    results["command"] = " ".join(sys.argv)
    results["config"] = {k: str(v) for k, v in dataclasses.asdict(base).items()}
    (args.out / "kd_vs_ce.json").write_text(json.dumps(results, indent=2))

    plot(results, args.out / "kd_vs_ce.png")
    for name in ("kd", "ce"):
        last = results[name]["eval"][-1]
        print(f"{name}: step {last['step']} held-out KL {last['kl']:.4f} CE {last['ce']:.4f} "
              f"({results[name]['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
