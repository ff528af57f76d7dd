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
import dataclasses
import json
import sys
import time
from pathlib import Path


def parse_variant(spec: str) -> tuple[str, dict]:
    parts = spec.split(":")
    kw: dict = {"optimizer": parts[0]}
    for part in parts[1:]:
        if part.startswith("lr="):
            kw["lr"] = float(part[3:])
        else:
            kw["foam_level"] = int(part)
    return spec.replace(":", "_").replace("=", ""), kw


def eval_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == "eval"]


def state_bytes(run_dir: Path) -> int | None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return next((r["optimizer_state_bytes"] for r in reversed(rows) if "optimizer_state_bytes" in r), None)


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
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True, help="a complete cache of the recipe's teacher")
    ap.add_argument("--recipe", type=Path, default=None)
    ap.add_argument("--variants", default="adamw,foam:2,adamw8bit")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from OUT/convergence.json")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads((args.out / "convergence.json").read_text()), args.out / "convergence.png")
        return

    from pipelines.defaults import default_teacher_dir
    from pipelines.recipe import builtin_recipe, load_recipe, train_config
    from student.trainer import train

    recipe = load_recipe(args.recipe or builtin_recipe("quickstart"))
    recipe.stage_one.cache.out = args.cache
    for key, value in (("steps", args.steps), ("eval_every", args.eval_every)):
        if value is not None:
            recipe.train[key] = value
    base = train_config(recipe, recipe.stage_one.teacher.model or default_teacher_dir())
    results = {"command": " ".join(sys.argv), "config": {k: str(v) for k, v in dataclasses.asdict(base).items()},
               "runs": {}}
    for spec in args.variants.split(","):
        name, kw = parse_variant(spec)
        config = dataclasses.replace(base, out=str(args.out / name), **kw)
        start = time.perf_counter()
        train(config)
        label = f"{spec} (lr {config.lr:g})"
        results["runs"][name] = {"label": label, "overrides": kw, "seconds": time.perf_counter() - start,
                                 "optimizer_state_bytes": state_bytes(args.out / name),
                                 "eval": eval_rows(args.out / name)}
        last = results["runs"][name]["eval"][-1]
        print(f"{label}: step {last['step']} held-out KL {last['kl']:.4f} CE {last['ce']:.4f} "
              f"state {results['runs'][name]['optimizer_state_bytes']:,} B", flush=True)
        (args.out / "convergence.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "convergence.png")


if __name__ == "__main__":
    main()
